"""How an architecture's images become LLM tokens on the host: each image's token count, the visuals its LLM
family's position provider numbers, the blank image an image-free batch runs the image path on.

The model's image path holds one (``model.image_path.layout``, its ``LAYOUT``), made from the tower and the connector's
tokens per image. ``ImageLayout`` is every architecture's
whose images take a fixed count (a Q-Former's queries, a projector's patch tokens), numbered as text is; an image
path whose count depends on the image's size, or whose tokens lie on a grid, is a subclass
(``lavis_ds.models.qwen_vl``: a Qwen-VL tower's grid of merged tokens). The counts are the one count the prompt's
placeholders and the splice both follow (``lavis_ds.models.image_tokens``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lavis_ds.models.image_tokens import Size, image_sizes, per_sample
from lavis_ds.models.positions import Visual
from lavis_ds.models.prompt import image_counts


class ImageLayout:
    """``tokens_per_image`` tokens per image, without a grid; ``image_size`` pixel squares."""

    def __init__(self, tower: nn.Module, tokens_per_image: int | None, owner: str = "the model"):
        """``owner``: the architecture, as messages name it."""
        self.tokens_per_image = tokens_per_image
        self.image_size = tower.image_size
        self.owner = owner

    def tokens_for_image(self, size: Size) -> int:
        """LLM tokens an image of ``size`` takes (its grid row, or its pixels' (height, width))."""
        return self.tokens_per_image

    def counts(self, samples: dict[str, Any]) -> list[int]:
        """Each image's token count (``tokens_for_image``), in the batch's flat image order."""
        return [self.tokens_for_image(size) for size in image_sizes(samples)]

    def visuals(self, samples: dict[str, Any]) -> list[Visual]:
        """Each image as the LLM's position provider sees it (flat image order): its token count and, for an image
        path that lays its tokens out on a grid, that grid. Here: no grid, numbered as text is."""
        return [Visual(n) for n in self.counts(samples)]

    def runs(self, samples: dict[str, Any]) -> list[list[Visual]]:
        """Each sample's placeholder runs as the position provider numbers them, in order: its ``visuals`` (a
        family that writes a video as several runs gives each run)."""
        return per_sample(self.visuals(samples), image_counts(samples))

    def blank(self, device: torch.device) -> dict[str, Any]:
        """The image fields of one blank image, which a batch without images runs the image path on:
        ``image [1, 3, image_size, image_size]``."""
        return {"image": torch.zeros((1, 3, self.image_size, self.image_size), device=device)}

    def host_fields(self, prepared: dict[str, Any]) -> dict[str, Any]:
        """A prepared batch with the layout the host reads kept on the host. Here: as given."""
        return prepared
