"""Qwen2-VL and Qwen2.5-VL (``qwen2_vl``, ``qwen2_5_vl``): a Qwen-VL tower, the ``patch_merger``, Qwen-VL's text model.

Each image keeps (nearly) its own size: the ``qwen_vl_image`` processor gives its flat patches and grid, the batch
carries every image's patches end to end (``image``), one ``image_grid_thw`` row per image and, for videos,
``second_per_grid_t``. An image of grid (t, h, w) takes ``t*h*w // 4`` LLM tokens (``tokens_for_grid``), reserved in
the prompt between ``<|vision_start|>`` and ``<|vision_end|>`` as Qwen2-VL's chat template and processor write them
(``<|image_pad|>`` for an image, ``<|video_pad|>`` for a video: a visual with ``second_per_grid_t``),
and numbered by M-RoPE over its grid of merged tokens (the text model's ``mrope`` provider; the batch carries the
rows as ``rope_position_ids``). transformers' ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` hold the same parts (``visual`` with its ``merger``, ``language_model``,
``lm_head``); its published folders load with ``load_pretrained`` (the family record: ``lavis_ds.models.hf.qwen_vl``).

A batch may also give images as a normalised ``[N, 3, H, W]`` tensor with sides that are multiples of 28 px (the
tensors the chat app and the generic tests make): each is then a still image at that size, patchified here.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Callable

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.common.errors import LavisDsError
from lavis_ds.models.flops import ZERO, FlopModel, Flops
from lavis_ds.models.image_layout import ImageLayout
from lavis_ds.models.image_path import ImagePath
from lavis_ds.models.image_tokens import GRID_KEY, SECONDS_KEY, Size, image_sizes
from lavis_ds.models.positions import Visual
from lavis_ds.models.settings.qwen_vl import Qwen2VLSettings, Qwen25VLSettings, QwenVLSettings
from lavis_ds.models.towers.qwen_vl_layers import GridRows, grid_rows
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.processors.qwen_vl import tokens_for_grid


class GridImageLayout(ImageLayout):
    """A Qwen-VL tower's images: each of (nearly) its own size, ``tokens_for_grid`` tokens on its grid of merged
    tokens (for M-RoPE), the batch's grid kept as host rows; a normalised ``[N, 3, H, W]`` pixel tensor is still
    images at their size (patchified by ``patches_and_grid``)."""

    def __init__(self, tower: nn.Module, tokens_per_image: int | None, owner: str = "the model"):
        super().__init__(tower, tokens_per_image, owner)
        self.tower = tower  # its layout (patch and merge sizes), its processing, its patch embedding's kernel

    def tokens_for_image(self, size: Size) -> int:
        """An image's LLM tokens: ``tokens_for_grid`` of its grid row (t, h, w), or of the still image a pixel tensor
        of (height, width) px makes."""
        return tokens_for_grid(self.grid(size), self.tower.layout.merge_size)

    def visuals(self, samples: dict[str, Any]) -> list[Visual]:
        """Each image's grid of merged tokens, for M-RoPE, and its temporal spacing (``time_interval``)."""
        merge = self.tower.layout.merge_size
        seconds = samples.get(SECONDS_KEY)
        visuals = []
        for i, size in enumerate(image_sizes(samples)):
            t, h, w = self.grid(size)
            second = None if seconds is None else seconds[i]
            visuals.append(Visual(t * h * w // (merge * merge), (t, h // merge, w // merge),
                                  self.time_interval(second)))
        return visuals

    def time_interval(self, second_per_grid_t: float | None) -> float:
        """The spacing of a visual's temporal position ids: 1 (Qwen2-VL counts temporal patches)."""
        return 1.0

    def grid(self, size: Size) -> tuple[int, int, int]:
        """An image's grid row (t, h, w) of patches: its own, or the still image of a (height, width) px tensor."""
        if len(size) == 3:
            return tuple(int(v) for v in size)  # type: ignore[return-value]
        layout = self.tower.layout
        height, width = size
        factor = layout.patch_size * layout.merge_size
        if height % factor or width % factor:
            raise LavisDsError(f"an image tensor of {height}x{width} px (height x width) for {self.owner}: "
                               f"valid sides are multiples of {factor} px; give PIL images through the qwen_vl_image "
                               "processor (it resizes them), or pixel tensors at such a size")
        return 1, height // layout.patch_size, width // layout.patch_size

    def blank(self, device: torch.device) -> dict[str, Any]:
        """One merge window of zero patches (the smallest image the tower takes), with its grid (a host row)."""
        kernel = self.tower.patch_embed.kernel
        merge = self.tower.layout.merge_size
        width = kernel[0] * kernel[1] * kernel[2] * kernel[3]
        return {"image": torch.zeros((merge * merge, width), device=device), GRID_KEY: [(1, merge, merge)]}

    def host_fields(self, prepared: dict[str, Any]) -> dict[str, Any]:
        """The grid (``image_grid_thw``) as host rows of (t, h, w): layout the host reads (token counts, the tower's
        positions, spans and windows), which the engines then leave on the host (they move tensors only), so the
        forward reads it without waiting for the device."""
        grid = prepared.get(GRID_KEY)
        return {**prepared, GRID_KEY: grid_rows(grid)} if torch.is_tensor(grid) else prepared

    def patches_and_grid(self, images: torch.Tensor, samples: dict[str, Any]
                         ) -> tuple[torch.Tensor, torch.Tensor | GridRows]:
        """The batch's flat patches and grid rows: as given, or of normalised ``[N, 3, H, W]`` pixels (still images
        at their size)."""
        grid = samples.get(GRID_KEY)
        if grid is None:
            visuals = [self.tower.processing.still_patches(image) for image in images]
            images = torch.cat([v.pixel_values for v in visuals]).to(images.device)
            grid = [tuple(v.grid_thw.tolist()) for v in visuals]
        return images, grid


class TimedGridImageLayout(GridImageLayout):
    """Qwen2.5-VL's: a video's temporal ids spaced in absolute time."""

    def time_interval(self, second_per_grid_t: float | None) -> float:
        """``tokens_per_second * second_per_grid_t`` for a video (transformers' get_rope_index); 1 for an image."""
        if second_per_grid_t is None:
            return 1.0
        return float(self.tower.config.tokens_per_second) * float(second_per_grid_t)


class GridImagePath(ImagePath):
    """``patch_merger(tower(patches, grid))``: flat ``[sum of tokens, llm_hidden]``, image by image; each image's
    tower and merger FLOPs taken from its size (the tower's cost is linear in the patches plus quadratic in each
    attention span)."""

    LAYOUT = GridImageLayout

    def encode(self, images: torch.Tensor, samples: dict[str, Any]) -> torch.Tensor:
        return self.connector(self.tower(*self.layout.patches_and_grid(images, samples)))

    def flop_model(self) -> FlopModel:
        # Images of the same size recur; the FLOPs of a size are read once (they hold while the switches do).
        return replace(super().flop_model(),
                       image_path_of_size=lru_cache(maxsize=4096)(self.flops_of_size))

    def flops(self) -> tuple[Flops, Callable[[int], Flops], bool]:
        """No cost per image (it depends on the image's size: ``flops_of_size``) and whether the merger's
        output needs a gradient, which no size changes (read on the smallest image)."""
        merge = self.tower.layout.merge_size
        _, image_grad = self._flops_of_grid((1, merge, merge))
        return ZERO, lambda text_tokens: ZERO, image_grad

    def flops_of_size(self, size: Size) -> tuple[Flops, Flops]:
        """The tower's and the merger's FLOPs on one image of ``size`` (a grid row, or a pixel tensor's sides)."""
        return self._flops_of_grid(self.layout.grid(size))[0]

    def _flops_of_grid(self, grid: tuple[int, int, int]) -> tuple[tuple[Flops, Flops], bool]:
        tower, features_grad = self.tower.flops_for_grid([grid])
        connector, image_grad = self.connector.flops(grid[0] * grid[1] * grid[2], features_grad)
        return (tower, connector), image_grad


class TimedGridImagePath(GridImagePath):
    """Qwen2.5-VL's: a video's temporal ids spaced in absolute time (``TimedGridImageLayout``)."""

    LAYOUT = TimedGridImageLayout


class QwenVL(VisionLLM):
    """What Qwen2-VL and Qwen2.5-VL share; the subclasses name their parts, presets and video time spacing."""

    SETTINGS = QwenVLSettings
    IMAGE_PATH = GridImagePath


@reg.models.register("qwen2_vl")
class Qwen2VL(QwenVL):
    """Qwen2-VL: the ``qwen2_vl`` tower, ``patch_merger`` with LayerNorm, Qwen2-VL's text model."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "2b": "models/qwen2_vl/2b.yaml",
        "7b": "models/qwen2_vl/7b.yaml",
        "tiny": "models/qwen2_vl/tiny.yaml",
    }
    SETTINGS = Qwen2VLSettings


@reg.models.register("qwen2_5_vl")
class Qwen25VL(QwenVL):
    """Qwen2.5-VL: the ``qwen2_5_vl`` tower (windowed attention), ``patch_merger`` with RMSNorm, Qwen2.5-VL's text
    model; a video's temporal ids are spaced in absolute time."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "3b": "models/qwen2_5_vl/3b.yaml",
        "7b": "models/qwen2_5_vl/7b.yaml",
        "tiny": "models/qwen2_5_vl/tiny.yaml",
    }
    SETTINGS = Qwen25VLSettings
    IMAGE_PATH = TimedGridImagePath
