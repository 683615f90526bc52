"""The vision-tower interface, and the image processing that travels with a tower (as timm's ``pretrained_cfg``).

A tower is a :class:`VisionTower`: an ``nn.Module`` that turns normalised images ``[N, 3, H, W]`` into
``[N, num_tokens, num_features]`` features. It tells its ``image_size``, ``num_features`` (output width),
``num_tokens`` (tokens per image after feature selection) and ``blocks()`` (the transformer blocks a
sharding engine wraps one by one), reads published weights with ``load_pretrained(path)``, and carries its
``processing``: the resize, mean/std and padding its weights were trained with (an
:class:`~lavis_ds.processors.image.ImageProcessing`). The ``tower_image_train`` / ``tower_image_eval`` processors
do that processing: the config loader fills their keys from the model's tower (``lavis_ds.image_config``), so the
images a model trains and is evaluated on are prepared as its tower was trained and as its export serves them.

To add a tower, subclass :class:`VisionTower`, register it with ``@reg.vision_towers.register("name")`` (``from lavis_ds.common import registry as reg``)
in a module listed under ``imports:``, and give it keyword-only constructor arguments (its config keys).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from lavis_ds.models.flops import Flops
from lavis_ds.models.parts import Part, check_keys
# The processing a tower carries is the processors' dataclass: a tower_image_* processor does it (re-exported here).
from lavis_ds.processors.image import CLIP_MEAN, CLIP_STD, ImageProcessing, expand_to_square  # noqa: F401


class VisionTower(Part):
    """Base class of registered vision towers (see the module docstring for the interface).

    Subclasses set ``image_size``, ``num_features``, ``num_tokens`` and ``processing`` in their constructor
    and implement ``forward``, ``blocks`` and ``load_pretrained``.
    """

    # True: images of their own sizes as flat patches, ``forward(pixel_values [P, D], grid_thw [n, 3]) -> [P, C]``,
    # a token count per image (``tokens_for_grid``) and ``image_size`` / ``num_tokens`` None (``towers.qwen_vl``).
    FLAT_FEATURES = False
    image_size: int
    num_features: int
    num_tokens: int
    processing: ImageProcessing

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """``images [N, 3, image_size, image_size]`` -> ``[N, num_tokens, num_features]``."""
        raise NotImplementedError

    def flops(self) -> tuple[Flops, bool] | None:
        """FLOPs of the tower on one image, forward and training, by the rule in ``lavis_ds.models.flops``, and
        whether its features need a gradient; None if the tower does not say (no MFU is logged)."""
        return None

    def blocks(self) -> list[nn.Module]:  # pragma: no cover - interface
        """The tower's transformer blocks, in order: the units FSDP shards and gathers one at a time."""
        raise NotImplementedError

    def load_pretrained(self, path: str) -> None:  # pragma: no cover - interface
        """Copy published weights from ``path`` (a file or folder) into the tower, checked key for key."""
        raise NotImplementedError(f"{type(self).__name__} cannot read published weights")

    @classmethod
    def from_config(cls, section: Mapping[str, Any], path: str = "vision_tower") -> "VisionTower":
        """Build from a config section: the constructor's keys plus ``pretrained`` (weights to load) and
        ``freeze`` (no gradients, eval mode; default true: towers are usually frozen)."""
        section = dict(section)
        check_keys(cls, section, path, extra=("pretrained", "freeze"))
        pretrained, frozen = section.pop("pretrained", None), section.pop("freeze", True)
        tower = cls.from_folder(pretrained, section, path) if pretrained else cls(**section)
        if pretrained:
            tower.load_pretrained(pretrained)
        if frozen:
            tower.freeze_submodule()
        return tower

    @classmethod
    def from_folder(cls, folder: str, section: Mapping[str, Any], path: str) -> "VisionTower":
        """The tower a published ``folder`` describes (towers whose architecture lives in a config.json read it
        here); by default the section alone."""
        return cls(**section)
