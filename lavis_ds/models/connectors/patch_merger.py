"""Qwen-VL's ``patch_merger``: each 2x2 merge window of a Qwen-VL tower's patch features becomes one LLM token.

``norm`` (LayerNorm for Qwen2-VL, RMSNorm for Qwen2.5-VL), the four patches of a window side by side
(``view(-1, 4*C)``: the processor lays each window's patches out contiguously), ``Linear(4C, 4C)``, GELU,
``Linear(4C, llm_width)``. The parameters are named as transformers' ``visual.merger.*`` (``ln_q``, ``mlp.0``,
``mlp.2``), so ``load_pretrained`` reads a published Qwen2-VL / Qwen2.5-VL folder's merger by a prefix strip.

Its input is the tower's flat features ``[patches, C]`` (``FLAT_FEATURES``), its output ``[patches // 4, llm_width]``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.connectors.base import Connector
from lavis_ds.models.flops import Flops, Tally, trains
from lavis_ds.models.parts import PartError, load_exactly, read_safetensors
from lavis_ds.models.towers.qwen_vl_layers import RMSNorm

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": RMSNorm}
MERGER_PREFIXES = ("visual.merger.", "model.visual.merger.")


@reg.connectors.register("patch_merger")
class PatchMerger(Connector):
    """Qwen2-VL's (``norm: layernorm``) and Qwen2.5-VL's (``norm: rmsnorm``) patch merger."""

    FLAT_FEATURES = True

    def __init__(self, *, vision_width: int, llm_width: int, norm: Literal["layernorm", "rmsnorm"] = "layernorm",
                 spatial_merge_size: int = 2):
        """
        Args:
            vision_width: The tower's ``num_features`` (given by the architecture).
            llm_width: The LLM's hidden size (given by the architecture).
            norm: ``layernorm`` (Qwen2-VL) or ``rmsnorm`` (Qwen2.5-VL), over each patch before merging.
            spatial_merge_size: Patches per side of a merge window (the tower's; 2 in every published model).
        """
        super().__init__(vision_width=vision_width, llm_width=llm_width)
        if norm not in NORMS:
            raise PartError(f"connector.norm: {norm!r}; valid: layernorm (Qwen2-VL), rmsnorm (Qwen2.5-VL)")
        self.unit = spatial_merge_size * spatial_merge_size
        self.hidden_size = vision_width * self.unit
        self.ln_q = NORMS[norm](vision_width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, llm_width))

    def tokens_per_image(self, vision_tokens: int) -> int:
        """One LLM token per merge window of the image's ``vision_tokens`` patches."""
        return vision_tokens // self.unit

    def forward(self, features: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        """``features [patches, vision_width]`` (a tower's flat features) -> ``[patches // 4, llm_width]``."""
        if features.shape[0] % self.unit:
            raise PartError(f"connector patch_merger: {features.shape[0]} patch features are not whole merge windows "
                            f"of {self.unit}; give a Qwen-VL tower's features, in the processor's patch order")
        features = features.to(self.mlp[0].weight.dtype)
        return self.mlp(self.ln_q(features).view(-1, self.hidden_size))

    def flops(self, vision_tokens: int, features_grad: bool, text_tokens: int = 0) -> tuple[Flops, bool]:
        """On one image's ``vision_tokens`` patch features: two linear layers per merged token."""
        tally = Tally()
        merged = vision_tokens // self.unit
        hidden = tally.linear(self.mlp[0], merged, features_grad | trains(self.ln_q))
        out = tally.linear(self.mlp[2], merged, hidden)
        return tally.flops(), out

    def load_pretrained(self, path: str) -> None:
        """The ``visual.merger.*`` (or ``model.visual.merger.*``) weights of a published Qwen2-VL / Qwen2.5-VL
        folder, checked by name and shape."""
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise PartError(f"connector.pretrained: {folder} is not a folder; expected a Qwen2-VL or Qwen2.5-VL "
                            "folder (its visual.merger.* weights)")
        state = read_safetensors(folder, lambda key: key.startswith(MERGER_PREFIXES), "connector.pretrained")
        ours = {key.split("merger.", 1)[1]: value for key, value in state.items()}
        load_exactly(self, ours, "connector.pretrained",
                     f"{folder}'s merger does not fit the patch_merger (norm {type(self.ln_q).__name__})")
