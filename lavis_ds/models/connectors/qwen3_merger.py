"""Qwen3-VL's ``qwen3_vl_merger``: the patch merger and the DeepStack mergers of a ``qwen3_vl`` tower.

Each merger makes one LLM token of a 2x2 merge window (the processor lays each window's patches out
contiguously): ``Linear(4C, 4C)``, GELU, ``Linear(4C, llm_width)``, after a LayerNorm over each patch (the merger
of the tower's last block) or over the window's four patches side by side (the DeepStack mergers, one per tapped
block: transformers' ``use_postshuffle_norm``). The parameters are named as transformers' ``visual.merger.*`` and
``visual.deepstack_merger_list.N.*`` (``norm``, ``linear_fc1``, ``linear_fc2``), so ``load_pretrained`` reads a
published Qwen3-VL folder's by a prefix strip.

``forward(features, {"taps": [...]})`` -> ``[patches // 4, (1 + deepstack_taps) * llm_width]``: the merged tokens,
then each DeepStack merger's tokens, side by side in the channels, so that they travel through the batch's image
order (packing, preference pairs) as one tensor; the ``qwen3_vl`` architecture splits them where it feeds the LLM.
Without taps (a tower that has none) it gives the merged tokens alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.connectors.base import Connector
from lavis_ds.models.flops import Flops, Tally, trains
from lavis_ds.models.parts import PartError, load_exactly, read_safetensors

VISUAL_PREFIXES = ("visual.", "model.visual.")
OWN_KEYS = ("merger.", "deepstack_merger_list.")


class WindowMerger(nn.Module):
    """One merger: ``linear_fc2(gelu(linear_fc1(window)))`` with a LayerNorm over each patch or, ``over_window``,
    over the window's four patches side by side."""

    def __init__(self, vision_width: int, unit: int, llm_width: int, over_window: bool):
        super().__init__()
        self.hidden_size, self.over_window = vision_width * unit, over_window
        self.norm = nn.LayerNorm(self.hidden_size if over_window else vision_width, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden_size, llm_width)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        windows = features.view(-1, self.hidden_size)
        windows = self.norm(windows) if self.over_window else self.norm(features).view(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(windows)))

    def flops(self, merged: int, features_grad: bool, tally: Tally) -> bool:
        return tally.linear(self.linear_fc2, merged, tally.linear(self.linear_fc1, merged,
                                                                   features_grad | trains(self.norm)))


@reg.connectors.register("qwen3_vl_merger")
class Qwen3VLMerger(Connector):
    """Qwen3-VL's patch merger (``merger``) and its DeepStack mergers (``deepstack_merger_list``)."""

    FLAT_FEATURES = True

    def __init__(self, *, vision_width: int, llm_width: int, deepstack_taps: int = 3, spatial_merge_size: int = 2):
        """
        Args:
            vision_width: The tower's ``num_features`` (given by the architecture).
            llm_width: The LLM's hidden size (given by the architecture).
            deepstack_taps: DeepStack mergers: one per block the tower taps (its
                ``vision_config.deepstack_visual_indexes``; 3 in every published model).
            spatial_merge_size: Patches per side of a merge window (the tower's; 2 in every published model).
        """
        super().__init__(vision_width=vision_width, llm_width=llm_width)
        if deepstack_taps < 0:
            raise PartError(f"connector.deepstack_taps: {deepstack_taps}; valid: 0 or more (one DeepStack merger per "
                            "tapped tower block)")
        self.unit = spatial_merge_size * spatial_merge_size
        self.deepstack_taps = deepstack_taps
        self.merger = WindowMerger(vision_width, self.unit, llm_width, over_window=False)
        self.deepstack_merger_list = nn.ModuleList(WindowMerger(vision_width, self.unit, llm_width, over_window=True)
                                                   for _ in range(deepstack_taps))

    def tokens_per_image(self, vision_tokens: int) -> int:
        """One LLM token per merge window of the image's ``vision_tokens`` patches."""
        return vision_tokens // self.unit

    def forward(self, features: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        """``features [patches, vision_width]`` and ``inputs["taps"]`` (the tapped blocks' features, as many as
        ``deepstack_taps``, or none) -> ``[patches // 4, (1 + taps) * llm_width]``."""
        taps = list((inputs or {}).get("taps") or ())
        if features.shape[0] % self.unit:
            raise PartError(f"connector qwen3_vl_merger: {features.shape[0]} patch features are not whole merge "
                            f"windows of {self.unit}; give a Qwen-VL tower's features, in the processor's patch order")
        if taps and len(taps) != self.deepstack_taps:
            raise PartError(f"connector qwen3_vl_merger: {len(taps)} tapped tower blocks for {self.deepstack_taps} "
                            "DeepStack mergers; valid: connector.deepstack_taps equal to the number of the tower's "
                            "vision_config.deepstack_visual_indexes")
        dtype = self.merger.linear_fc1.weight.dtype
        merged = [self.merger(features.to(dtype))]
        merged += [merger(tap.to(dtype)) for merger, tap in zip(self.deepstack_merger_list, taps)]
        return torch.cat(merged, dim=-1) if len(merged) > 1 else merged[0]

    def flops(self, vision_tokens: int, features_grad: bool, text_tokens: int = 0) -> tuple[Flops, bool]:
        """On one image's ``vision_tokens`` patch features: two linear layers per merged token and merger (the
        DeepStack mergers run on the taps the architecture gives, whose gradient is the features')."""
        tally = Tally()
        merged = vision_tokens // self.unit
        out = False
        for merger in (self.merger, *self.deepstack_merger_list):
            out |= merger.flops(merged, features_grad, tally)
        return tally.flops(), out

    def load_pretrained(self, path: str) -> None:
        """The ``visual.merger.*`` and ``visual.deepstack_merger_list.*`` weights (or ``model.visual.*``) of a
        published Qwen3-VL folder, checked by name and shape."""
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise PartError(f"connector.pretrained: {folder} is not a folder; expected a Qwen3-VL folder (its "
                            "visual.merger.* and visual.deepstack_merger_list.* weights)")
        own = tuple(prefix + key for prefix in VISUAL_PREFIXES for key in OWN_KEYS)
        state = read_safetensors(folder, lambda key: key.startswith(own), "connector.pretrained")
        ours = {key.split("visual.", 1)[1]: value for key, value in state.items()}
        load_exactly(self, ours, "connector.pretrained",
                     f"{folder}'s mergers do not fit the qwen3_vl_merger ({self.deepstack_taps} DeepStack mergers)")
