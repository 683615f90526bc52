"""The Qwen2-VL and Qwen2.5-VL vision towers (``qwen2_vl``, ``qwen2_5_vl``): images of their own sizes as flat patches.

``forward(pixel_values [P, 3*2*14*14], grid_thw [n, 3]) -> [P, width]``: the patch features of ``n`` images or
videos laid end to end (as ``lavis_ds.processors.qwen_vl`` makes them), in the processor's patch order, before the
merger (the ``patch_merger`` connector merges each 2x2 window into one LLM token). Qwen2.5-VL's windowed blocks run
on patches reordered window by window; the tower restores the processor's order (at merge-window granularity)
before returning, which is what transformers does after its merger, so the merged tokens agree.

Parameter names are transformers' ``visual.*`` names without the merger: ``load_pretrained(folder)`` reads the
``visual.*`` (published) or ``model.visual.*`` (transformers 5) weights of a ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` folder, and a folder given as ``pretrained`` also gives the architecture
(its config.json's ``vision_config``).

An image of grid (t, h, w) gives ``t*h*w`` patch features and ``t*h*w // 4`` LLM tokens (``tokens_for_grid``);
its FLOPs are linear in its patches plus quadratic in each attention span (``flops_for_grid``).

Qwen3-VL's tower (``towers.qwen3_vl``) is a subclass: it adds learned positions in ``embed`` and names the blocks
``forward_taps`` also returns the outputs of (``tap_layers``: its DeepStack layers).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2_5_VLVisionConfig, Qwen2VLVisionConfig

from lavis_ds.common import registry as reg
from lavis_ds.models.flops import Flops, Tally, patch_embedding, trains
from lavis_ds.models.parts import PartError, load_exactly, read_safetensors
from lavis_ds.models.towers.base import VisionTower
from lavis_ds.models.towers.qwen_vl_layers import (GeluMlp, GridRows, LinearFcMlp, PatchEmbed, RMSNorm, Spans,
                                                   SwiGluMlp, VisionBlock, VisionRotary, frame_spans, grid_rows,
                                                   patch_positions, window_order)
from lavis_ds.models.towers.qwen_vl_spec import Layout, QwenVLSpec
from lavis_ds.processors.qwen_vl import MAX_PIXELS, MIN_PIXELS, QwenVisionInputError, QwenVLProcessing, tokens_for_grid

# The published folders' weight prefixes of the tower: transformers 4.x / the Hub (visual.*), transformers 5
# (model.visual.*). The merger under them is the patch_merger connector's.
VISUAL_PREFIXES = ("visual.", "model.visual.")
# The mergers under them, which the connectors read (Qwen3-VL's DeepStack mergers too).
MERGER_KEYS = (".merger.", ".deepstack_merger_list.")


class BlockList(nn.ModuleList):
    """The tower's blocks as a ModuleList (named ``blocks.N``, as transformers' ``visual.blocks.N``) that, called,
    gives them as a list: ``VisionTower.blocks()``."""

    def forward(self) -> list[nn.Module]:
        return list(self)


class QwenVLTower(VisionTower):
    """What the Qwen-VL towers share; subclasses name their kind (``SPEC``: config class, presets, block kind)."""

    FLAT_FEATURES = True
    SPEC: ClassVar[QwenVLSpec]
    # The blocks whose outputs the tower also gives (``forward_taps``): Qwen3-VL's DeepStack layers.
    tap_layers: tuple[int, ...] = ()

    def __init__(self, *, preset: str, vision_config: dict[str, Any] | None = None, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS, use_grad_checkpoint: bool = False, video_fps: float | None = None,
                 video_min_pixels: int | None = None, video_max_pixels: int | None = None):
        """
        Args:
            preset: Architecture by name (``SPEC.presets``: the published sizes' towers, ``tiny`` for tests);
                ``vision_config`` overrides its keys. A published folder (``pretrained``) gives its own.
            vision_config: Keys of the transformers vision config (``depth``, ``num_heads``, ...).
            min_pixels: Least area an image is resized to (the tower's processing; Qwen's default 56*56).
            max_pixels: Most area an image is resized to (Qwen's default 28*28*1280: at most 1280 LLM tokens).
            use_grad_checkpoint: Recompute each block's activations in backward (a trained tower on large images).
            video_fps: Frames a video is sampled at per second (default: the family's, ``SPEC.video_sampling``:
                Qwen3-VL's 2; none for Qwen2-VL's, whose videos take the dataset's ``max_frames``). A published
                folder's video processor gives its own.
            video_min_pixels: Least area of a video's frames together (default: the family's; none: each frame
                bounded as an image).
            video_max_pixels: Most area of a video's frames together (default: the family's).
        """
        super().__init__()
        spec = self.SPEC
        config = spec.config(preset, vision_config or {}, self.tower_name())
        layout = spec.layout_of(config)
        if layout.width % layout.heads or (layout.width // layout.heads) % 4:
            raise PartError(f"vision_tower.vision_config: width {layout.width} over {layout.heads} heads; valid: "
                            "a head size that is a multiple of 4 (2-D rotary turns a quarter with each axis)")
        self.config, self.layout = config, layout
        self.patch_embed = PatchEmbed(layout.patch_size, layout.temporal_patch_size, layout.in_channels, layout.width,
                                      bias=spec.patch_bias)
        self.rotary_pos_emb = VisionRotary(layout.width // layout.heads, layout.theta)
        self.blocks = BlockList(VisionBlock(layout.width, layout.heads, spec.norm, spec.mlp(layout))
                                for _ in range(layout.depth))
        self.num_features = layout.width
        self.use_grad_checkpoint = use_grad_checkpoint
        self.image_size = None  # images keep (nearly) their own size: see processing
        self.num_tokens = None  # per image: tokens_for_grid
        try:
            self.processing = QwenVLProcessing(min_pixels, max_pixels, mean=spec.image_mean, std=spec.image_std,
                                               patch_size=layout.patch_size, merge_size=layout.merge_size,
                                               temporal_patch_size=layout.temporal_patch_size,
                                               **spec.video_settings(video_fps, video_min_pixels, video_max_pixels))
        except QwenVisionInputError as e:
            raise PartError(f"vision_tower: {e}") from None

    def attention_plan(self, grid_thw: GridRows) -> tuple[torch.Tensor | None, list[list[int]]]:
        """The merge-window order the blocks run in (None: the processor's; on the host) and each block's span
        lengths, from the grid's host rows."""
        spans = frame_spans(grid_thw)
        return None, [spans] * len(self.blocks)

    # ----------------------------------------------------------------- the tower
    @classmethod
    def tower_name(cls) -> str:
        return next(name for name in reg.vision_towers if reg.vision_towers.get(name) is cls)

    def tokens_for_grid(self, grid_thw: torch.Tensor | list[int]) -> int:
        """LLM tokens of one image or video of this grid (after the 2x2 merger): the processor's count."""
        return tokens_for_grid(grid_thw, self.layout.merge_size)

    def tokens_for_size(self, height: int, width: int, frames: int = 1) -> int:
        """LLM tokens of an image of ``height`` x ``width`` px (or ``frames`` video frames) as given."""
        return self.processing.tokens_for_size(height, width, frames)

    @property
    def blocks(self) -> "BlockList":  # type: ignore[override]
        """The blocks: ``tower.blocks()`` is the interface's list (sharding units), and ``blocks.N.*`` are
        transformers' parameter names, so one attribute serves both (a :class:`BlockList`)."""
        return self._modules["blocks"]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | GridRows) -> torch.Tensor:
        """``pixel_values [P, 3*t*p*p]``, ``grid_thw`` (n (t, h, w) rows, or a ``[n, 3]`` tensor) -> ``[P, width]``
        patch features, processor order.

        The plan (positions, spans, windows) is host arithmetic on the grid: given as rows (a prepared batch's,
        ``QwenVL.prepare_batch``), the forward makes the host wait for the device nowhere; a grid tensor on a GPU
        costs one sync to read."""
        return self.forward_taps(pixel_values, grid_thw)[0]

    def embed(self, pixel_values: torch.Tensor, grid_thw: GridRows) -> torch.Tensor:
        """The patches' input to the first block: their embedding (Qwen3-VL adds its learned positions)."""
        return self.patch_embed(pixel_values)

    def forward_taps(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | GridRows
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The patch features (``forward``) and the outputs of the blocks in ``tap_layers``, each ``[P, width]`` in
        the processor's order."""
        grid_thw = self._checked_grid(pixel_values, grid_thw)
        unit = self.layout.merge_size ** 2
        x = self.embed(pixel_values, grid_thw)
        # Its index tensors go where the patches are, without making the host wait.
        positions = patch_positions(grid_thw, self.layout.merge_size).to(x.device, non_blocking=True)
        order, block_spans = self.attention_plan(grid_thw)
        if order is not None:  # run the blocks window by window (whole merge windows move together)
            order = order.to(x.device, non_blocking=True)
            x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
            positions = positions.view(-1, unit, 2)[order].flatten(0, 1)
        rotary = self.rotary_pos_emb(positions)
        plans: dict[tuple[int, ...], Spans] = {}
        taps = []
        for index, (block, lengths) in enumerate(zip(self.blocks, block_spans)):
            spans = plans.setdefault(tuple(lengths), Spans.from_lengths(lengths, x.device))
            if self.use_grad_checkpoint and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, spans, rotary, use_reentrant=False)
            else:
                x = block(x, spans, rotary)
            if index in self.tap_layers:
                taps.append(x)
        if order is not None:
            restore = torch.argsort(order)
            x, *taps = (y.view(-1, unit, y.shape[-1])[restore].flatten(0, 1) for y in (x, *taps))
        return x, taps

    def _checked_grid(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | GridRows) -> GridRows:
        rows = grid_rows(grid_thw)
        patches = sum(t * h * w for t, h, w in rows)
        m = self.layout.merge_size
        if patches != pixel_values.shape[0] or any(h % m or w % m for _, h, w in rows):
            raise PartError(f"{self.tower_name()} tower: pixel_values has {pixel_values.shape[0]} patches but grid_thw "
                            f"{[list(row) for row in rows]} describes {patches}; valid: one (t, h, w) row per image, "
                            f"h and w multiples of {m}, as lavis_ds.processors.qwen_vl makes them")
        return rows

    # ----------------------------------------------------------------- FLOPs
    def flops_for_grid(self, grid_thw: torch.Tensor | list[list[int]]) -> tuple[Flops, bool]:
        """FLOPs of the tower on the images of ``grid_thw`` ``[n, 3]`` (forward and training, by the rule in
        ``lavis_ds.models.flops``) and whether its features need a gradient: per patch, the patch embedding and every
        linear layer; per block, attention's two matmuls over the sum of its spans' squared lengths."""
        rows = grid_rows(grid_thw)
        patches = sum(t * h * w for t, h, w in rows)
        _, block_spans = self.attention_plan(rows)
        tally = Tally()
        x = patch_embedding(self.patch_embed.proj, patches, tally)
        for block, lengths in zip(self.blocks, block_spans):
            attn = block.attn
            qkv = tally.linear(attn.qkv, patches, x | trains(block.norm1))
            pairs = sum(length * length for length in lengths)
            mixed = tally.attention(pairs, 1, attn.proj.in_features, qkv, qkv, qkv)
            x |= tally.linear(attn.proj, patches, mixed)
            x |= self._mlp_flops(block.mlp, patches, x | trains(block.norm2), tally)
        return tally.flops(), x

    @staticmethod
    def _mlp_flops(mlp: nn.Module, rows: int, grad: bool, tally: Tally) -> bool:
        if isinstance(mlp, SwiGluMlp):
            gated = tally.linear(mlp.gate_proj, rows, grad) | tally.linear(mlp.up_proj, rows, grad)
            return tally.linear(mlp.down_proj, rows, gated)
        if isinstance(mlp, LinearFcMlp):
            return tally.linear(mlp.linear_fc2, rows, tally.linear(mlp.linear_fc1, rows, grad))
        return tally.linear(mlp.fc2, rows, tally.linear(mlp.fc1, rows, grad))

    def flops(self) -> None:
        """None: a Qwen-VL tower's cost depends on each image's size; ``flops_for_grid`` gives it per image."""
        return None

    # ----------------------------------------------------------------- published folders
    @classmethod
    def from_folder(cls, folder: str, section: Mapping[str, Any], path: str) -> "QwenVLTower":
        """The tower of a published folder: its config.json's ``vision_config`` (model_type ``SPEC.model_type``)."""
        return cls(**cls.SPEC.folder_section(folder, section, path, cls.tower_name()))

    def load_pretrained(self, path: str) -> None:
        """The ``visual.*`` / ``model.visual.*`` weights of a published folder (the merger left to the connector),
        every tower weight checked by name and shape."""
        folder = Path(path).expanduser()
        state = read_safetensors(folder, lambda key: key.startswith(VISUAL_PREFIXES)
                                 and not any(merger in key for merger in MERGER_KEYS), "vision_tower.pretrained")
        ours = {key.split("visual.", 1)[1]: value for key, value in state.items()}
        if not ours:
            model_class = self.SPEC.config_class.__name__.replace("VisionConfig", "ForConditionalGeneration")
            raise PartError(f"vision_tower.pretrained: {folder} holds no visual.* or model.visual.* weights; expected "
                            f"a {model_class} folder")
        load_exactly(self, ours, "vision_tower.pretrained",
                     f"{folder}'s vision tower does not fit the {self.tower_name()} tower")


def qwen2_vl_layout(config: Qwen2VLVisionConfig) -> Layout:
    return Layout(config.embed_dim, config.depth, config.num_heads, int(config.embed_dim * config.mlp_ratio),
                  config.hidden_act, config.patch_size, config.temporal_patch_size, config.spatial_merge_size,
                  config.in_channels, config.rope_parameters["rope_theta"])


def qwen2_5_vl_layout(config: Qwen2_5_VLVisionConfig) -> Layout:
    return Layout(config.hidden_size, config.depth, config.num_heads, config.intermediate_size, config.hidden_act,
                  config.patch_size, config.temporal_patch_size, config.spatial_merge_size, config.in_channels,
                  config.rope_parameters["rope_theta"])


# The towers of Qwen2-VL-2B and -7B are the same ViT; only the merger's output width (hidden_size) differs.
QWEN2_VL_PRESETS = {
    "2b": dict(hub_id="Qwen/Qwen2-VL-2B-Instruct", depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16,
               hidden_size=1536),
    "7b": dict(hub_id="Qwen/Qwen2-VL-7B-Instruct", depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16,
               hidden_size=3584),
    "tiny": dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=48),
}
_QWEN2_5_VL_PUBLISHED = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                             fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
QWEN2_5_VL_PRESETS = {
    "3b": dict(hub_id="Qwen/Qwen2.5-VL-3B-Instruct", **_QWEN2_5_VL_PUBLISHED, out_hidden_size=2048),
    "7b": dict(hub_id="Qwen/Qwen2.5-VL-7B-Instruct", **_QWEN2_5_VL_PUBLISHED, out_hidden_size=3584),
    "tiny": dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, window_size=112,
                 fullatt_block_indexes=[1, 3], out_hidden_size=48),
}


@reg.vision_towers.register("qwen2_vl")
class Qwen2VLTower(QwenVLTower):
    """Qwen2-VL's ViT: LayerNorm, GELU MLP, full attention within each frame."""

    SPEC = QwenVLSpec(Qwen2VLVisionConfig, "qwen2_vl", QWEN2_VL_PRESETS, qwen2_vl_layout,
                      lambda layout: GeluMlp(layout.width, layout.mlp_hidden, layout.act), nn.LayerNorm)

    def __init__(self, *, preset: Literal["2b", "7b", "tiny"] = "2b", **kwargs: Any):
        super().__init__(preset=preset, **kwargs)


@reg.vision_towers.register("qwen2_5_vl")
class Qwen25VLTower(QwenVLTower):
    """Qwen2.5-VL's ViT: RMSNorm, SwiGLU MLP, attention within 112 px windows except in ``fullatt_block_indexes``
    (within each frame there)."""

    SPEC = QwenVLSpec(Qwen2_5_VLVisionConfig, "qwen2_5_vl", QWEN2_5_VL_PRESETS, qwen2_5_vl_layout,
                      lambda layout: SwiGluMlp(layout.width, layout.mlp_hidden, layout.act), RMSNorm)

    def __init__(self, *, preset: Literal["3b", "7b", "tiny"] = "3b", **kwargs: Any):
        super().__init__(preset=preset, **kwargs)
        merged_px = self.layout.patch_size * self.layout.merge_size
        if self.config.window_size % merged_px:
            raise PartError(f"vision_tower.vision_config.window_size: {self.config.window_size}; valid: a multiple "
                            f"of {merged_px} px (one merge window; Qwen2.5-VL's is 112)")
        self.full_attention = frozenset(self.config.fullatt_block_indexes)
        bad = sorted(i for i in self.full_attention if not 0 <= i < self.layout.depth)
        if bad:
            raise PartError(f"vision_tower.vision_config.fullatt_block_indexes: {bad} outside the "
                            f"{self.layout.depth} blocks (0..{self.layout.depth - 1})")

    def attention_plan(self, grid_thw: GridRows) -> tuple[torch.Tensor | None, list[list[int]]]:
        merged_px = self.layout.patch_size * self.layout.merge_size
        order, windows = window_order(grid_thw, self.layout.merge_size, self.config.window_size // merged_px)
        frames = frame_spans(grid_thw)  # window order keeps each frame's patches together
        return order, [frames if i in self.full_attention else windows for i in range(self.layout.depth)]
