"""The connector interface: vision-tower features in, LLM-width image tokens out.

A connector is built with the tower's output width (``vision_width``) and the LLM's hidden size
(``llm_width``) plus its own keywords, says how many tokens it makes of a tower's ``tokens_per_image``,
and maps ``features [N, T, vision_width]`` to ``[N, tokens_per_image(T), llm_width]``.

A connector that reads the instruction (InstructBLIP's Q-Former) sets ``NEEDS_INSTRUCTION = True`` and
implements ``prepare(samples)``: the host-side preparation (tokenizing each image's instruction) whose
result ``forward`` receives as its second argument.

To add a connector, subclass :class:`Connector`, register it with ``@reg.connectors.register("name")`` (``from lavis_ds.common import registry as reg``)
in a module listed under ``imports:``, and give it keyword-only constructor arguments (its config keys).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from lavis_ds.models.flops import Flops
from lavis_ds.models.parts import Part, PartError, check_keys


class Connector(Part):
    """Base class of registered connectors (see the module docstring)."""

    NEEDS_INSTRUCTION = False
    # True: ``forward`` takes a flat-features tower's ``[patches, vision_width]`` (``VisionTower.FLAT_FEATURES``)
    # and ``tokens_per_image`` counts per image from its patches.
    FLAT_FEATURES = False

    def __init__(self, *, vision_width: int, llm_width: int):
        super().__init__()
        self.vision_width, self.llm_width = vision_width, llm_width

    def tokens_per_image(self, vision_tokens: int) -> int:
        """Image tokens the LLM sees per image, given the tower's tokens per image. Default: the same."""
        return vision_tokens

    def forward(self, features: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        """``features [N, T, vision_width]`` (and, for instruction connectors, ``prepare``'s output) ->
        ``[N, tokens_per_image(T), llm_width]``."""
        raise NotImplementedError

    def flops(self, vision_tokens: int, features_grad: bool, text_tokens: int = 0) -> tuple[Flops, bool] | None:
        """FLOPs of the connector on one image's ``vision_tokens`` tower features (whose gradient need is
        ``features_grad``) and ``text_tokens`` instruction tokens (instruction connectors), by the rule in
        ``lavis_ds.models.flops``, and whether its output needs a gradient; None if it does not say (no MFU)."""
        return None

    def prepare(self, samples: Mapping[str, Any]) -> dict[str, Any]:
        """Host-side inputs ``forward`` needs besides the features (tensors, one row per image). Default: none."""
        return {}

    def blocks(self) -> list[nn.Module]:
        """Transformer blocks FSDP shards one by one (a Q-Former's layers). Default: none."""
        return []

    def load_pretrained(self, path: str) -> None:
        """Copy published weights from ``path`` into the connector, checked key for key."""
        raise NotImplementedError(f"{type(self).__name__} cannot read published weights")

    @classmethod
    def from_config(cls, section: Mapping[str, Any], path: str = "connector", *, vision_width: int,
                    llm_width: int) -> "Connector":
        """Build from a config section: the constructor's keys (the widths come from the architecture), plus
        ``pretrained`` (weights to load) and ``freeze`` (the whole connector; default false)."""
        section = dict(section)
        check_keys(cls, section, path, extra=("pretrained", "freeze"))
        for given in ("vision_width", "llm_width"):
            if given in section:
                raise PartError(f"{path}.{given}: set by the architecture (the tower's and the LLM's widths); "
                                "leave it out")
        pretrained, frozen = section.pop("pretrained", None), section.pop("freeze", False)
        connector = cls(vision_width=vision_width, llm_width=llm_width, **section)
        connector.load_files()
        if pretrained:
            connector.load_pretrained(pretrained)
        if frozen:
            connector.freeze_submodule()
        return connector

    def load_files(self) -> None:
        """Read what the connector needs from disk besides weights (a tokenizer); the constructor never does."""
