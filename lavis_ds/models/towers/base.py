"""The vision-tower interface, and the image processing that travels with a tower (as timm's ``pretrained_cfg``).

A tower is a :class:`VisionTower`: an ``nn.Module`` that turns normalised images ``[N, 3, H, W]`` into
``[N, num_tokens, num_features]`` features. It tells its ``image_size``, ``num_features`` (output width),
``num_tokens`` (tokens per image after feature selection) and ``blocks()`` (the transformer blocks a
sharding engine wraps one by one), reads published weights with ``load_pretrained(path)``, and carries its
``processing``: the resize, mean/std and padding its weights were trained with.

To add a tower, subclass :class:`VisionTower`, register it with ``@reg.vision_towers.register("name")`` (``from lavis_ds.common import registry as reg``)
in a module listed under ``imports:``, and give it keyword-only constructor arguments (its config keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch
from PIL import Image
from torch import nn

from lavis_ds.models.flops import Flops
from lavis_ds.models.parts import Part, check_keys

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessing:
    """How a tower's images are prepared: the tower's counterpart of timm's ``pretrained_cfg``.

    Attributes:
        size: Square side the tower takes.
        mean: Per-channel mean the weights were trained with (RGB, 0..1).
        std: Per-channel std.
        resize: ``squash`` resizes to ``size x size`` (BLIP-2, SigLIP); ``shortest_edge`` resizes the
            shorter side to ``size`` and center-crops (CLIP's processor).
        pad_to_square: Pad the image to a square with the mean colour first (LLaVA-1.5's ``pad`` aspect
            ratio, its ``expand2square``): the whole image is seen, undistorted, nothing cropped.
    """

    size: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    resize: Literal["squash", "shortest_edge"] = "squash"
    pad_to_square: bool = False

    @property
    def pad_colour(self) -> tuple[int, int, int]:
        """The mean colour in 0..255, as LLaVA computes it: ``tuple(int(x * 255) for x in image_mean)``."""
        return tuple(int(x * 255) for x in self.mean)  # type: ignore[return-value]

    def transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """PIL image -> normalised ``[3, size, size]`` float tensor (bicubic resampling, as all three families)."""
        from torchvision import transforms
        from torchvision.transforms import InterpolationMode

        bicubic = InterpolationMode.BICUBIC
        steps: list[Any] = [_to_rgb]
        if self.pad_to_square:
            steps.append(lambda image: expand_to_square(image, self.pad_colour))
        if self.resize == "squash":
            steps.append(transforms.Resize((self.size, self.size), interpolation=bicubic))
        else:
            steps += [transforms.Resize(self.size, interpolation=bicubic), transforms.CenterCrop(self.size)]
        steps += [transforms.ToTensor(), transforms.Normalize(self.mean, self.std)]
        return transforms.Compose(steps)


def expand_to_square(image: Image.Image, colour: tuple[int, int, int]) -> Image.Image:
    """``image`` centred on a square canvas of ``colour`` (LLaVA's ``expand2square``)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), colour)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


def _to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


class VisionTower(Part):
    """Base class of registered vision towers (see the module docstring for the interface).

    Subclasses set ``image_size``, ``num_features``, ``num_tokens`` and ``processing`` in their constructor
    and implement ``forward``, ``blocks`` and ``load_pretrained``.
    """

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
