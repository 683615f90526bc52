"""Qwen3-VL's vision tower (``qwen3_vl``): the Qwen-VL tower with a learned position table and DeepStack taps.

What differs from Qwen2-VL's tower (``towers.qwen_vl``, whose forward, attention and loading it shares): 16 px
patches (a merged token covers 32 px), a Conv3d patch embedding with bias, LayerNorm blocks whose MLP is
``linear_fc1``/``linear_fc2``, images normalised by mean and std 0.5, and a learned ``pos_embed`` table of
``num_position_embeddings`` positions (a square, 48 x 48 in the published models) resampled bilinearly (corners
aligned) to each image's grid of patches and added to the patch embedding, beneath the 2-D rotary positions, as
transformers' ``Qwen3VLVisionModel`` does. The blocks of ``deepstack_visual_indexes`` are tapped
(``forward_taps``): the ``qwen3_vl_merger`` connector merges each tap with its own DeepStack merger, whose outputs
the LLM adds to its hidden states at the image positions after its first decoder layers (``models.qwen3_vl``).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from transformers import Qwen3VLVisionConfig

from lavis_ds.common import registry as reg
from lavis_ds.models.parts import PartError
from lavis_ds.models.towers.qwen_vl import QwenVLTower
from lavis_ds.models.towers.qwen_vl_layers import GridRows, LinearFcMlp, grid_rows
from lavis_ds.models.towers.qwen_vl_spec import Layout, QwenVLSpec
from lavis_ds.processors.qwen_vl_video import QWEN3_VL_FPS, QWEN3_VL_VIDEO_MAX_PIXELS, QWEN3_VL_VIDEO_MIN_PIXELS

# The towers of the published sizes (config.json vision_config); out_hidden_size is the LLM's width.
_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, num_position_embeddings=2304,
              deepstack_visual_indexes=[5, 11, 17])
_LARGE = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, num_position_embeddings=2304,
              deepstack_visual_indexes=[8, 16, 24])
QWEN3_VL_PRESETS = {
    "2b": dict(hub_id="Qwen/Qwen3-VL-2B-Instruct", **_SMALL, out_hidden_size=2048),
    "4b": dict(hub_id="Qwen/Qwen3-VL-4B-Instruct", **_SMALL, out_hidden_size=2560),
    "8b": dict(hub_id="Qwen/Qwen3-VL-8B-Instruct", **_LARGE, out_hidden_size=4096),
    "tiny": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, num_position_embeddings=16,
                 deepstack_visual_indexes=[0, 1], out_hidden_size=48),
}


def qwen3_vl_layout(config: Qwen3VLVisionConfig) -> Layout:
    return Layout(config.hidden_size, config.depth, config.num_heads, config.intermediate_size,
                  config.hidden_act, config.patch_size, config.temporal_patch_size, config.spatial_merge_size,
                  config.in_channels, config.rope_parameters["rope_theta"])


@reg.vision_towers.register("qwen3_vl")
class Qwen3VLTower(QwenVLTower):
    """Qwen3-VL's ViT: a learned position table on top of 2-D rotary, full attention within each frame, DeepStack
    taps."""

    SPEC = QwenVLSpec(Qwen3VLVisionConfig, "qwen3_vl", QWEN3_VL_PRESETS, qwen3_vl_layout,
                      lambda layout: LinearFcMlp(layout.width, layout.mlp_hidden, layout.act), nn.LayerNorm,
                      patch_bias=True, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                      # Qwen3-VL's video processor: 2 frames a second, and one pixel budget for all of a video's frames
                      video_sampling=dict(video_fps=QWEN3_VL_FPS, video_min_pixels=QWEN3_VL_VIDEO_MIN_PIXELS,
                                          video_max_pixels=QWEN3_VL_VIDEO_MAX_PIXELS))

    def __init__(self, *, preset: Literal["2b", "4b", "8b", "tiny"] = "2b", **kwargs: Any):
        super().__init__(preset=preset, **kwargs)
        depth, taps = self.layout.depth, list(self.config.deepstack_visual_indexes)
        if any(not 0 <= i < depth for i in taps) or taps != sorted(set(taps)):
            raise PartError(f"vision_tower.vision_config.deepstack_visual_indexes: {taps}; valid: increasing block "
                            f"indexes of the {depth} blocks (0..{depth - 1}), e.g. [8, 16, 24] of 27")
        self.tap_layers = tuple(taps)
        side = round(self.config.num_position_embeddings ** 0.5)
        if side * side != self.config.num_position_embeddings:
            raise PartError(f"vision_tower.vision_config.num_position_embeddings: "
                            f"{self.config.num_position_embeddings}; valid: a square (2304 = 48 x 48)")
        self.pos_embed = nn.Embedding(self.config.num_position_embeddings, self.layout.width)

    def embed(self, pixel_values: torch.Tensor, grid_thw: GridRows) -> torch.Tensor:
        """The patch embedding plus each patch's learned position, resampled to its image's grid."""
        x = self.patch_embed(pixel_values)
        return x + grid_positions(self.pos_embed.weight, grid_thw, self.layout.merge_size).to(x.dtype)


def grid_positions(table: torch.Tensor, grid_thw: torch.Tensor | GridRows, merge_size: int) -> torch.Tensor:
    """``[P, width]``: the square position ``table`` (``[side*side, width]``) resampled bilinearly, corners
    aligned, to each image's (h, w) patches and laid out as the processor lays out patches (merge window by merge
    window, every frame alike): ``F.interpolate(mode="bilinear", align_corners=True)`` as transformers'
    ``Qwen3VLVisionModel`` computes it with gather indices and weights."""
    side = round(table.shape[0] ** 0.5)
    square = table.view(side, side, -1)
    out = []
    for t, h, w in grid_rows(grid_thw):
        (r0, r1, dr), (c0, c1, dc) = (_taps(n, side, table.device) for n in (h, w))
        top = square[r0][:, c0] * (1 - dc)[None, :, None] + square[r0][:, c1] * dc[None, :, None]
        bottom = square[r1][:, c0] * (1 - dc)[None, :, None] + square[r1][:, c1] * dc[None, :, None]
        grid = top * (1 - dr)[:, None, None] + bottom * dr[:, None, None]  # [h, w, width]
        m = merge_size
        windows = grid.view(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
        out.append(windows.repeat(t, 1))
    return torch.cat(out)


def _taps(n: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two table rows around each of ``n`` points spread over ``0..side-1`` (ends included) and the weight of
    the second."""
    points = torch.linspace(0, side - 1, n, device=device, dtype=torch.float32)
    low = points.floor().long()
    high = (low + 1).clamp(max=side - 1)
    return low, high, points - low
