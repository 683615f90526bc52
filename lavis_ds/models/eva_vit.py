"""EVA-ViT-G, BLIP-2's vision tower, built on timm's ``Eva`` (sizes are data, see the YAML presets).

Subclassing timm's ``Eva`` (instead of wrapping it) keeps the parameter names of
LAVIS's ``eva_vit.py`` (``patch_embed.proj``, ``pos_embed``, ``blocks.N.attn.qkv``,
``attn.q_bias``/``v_bias``, ``mlp.fc1``...), so LAVIS ``eva_vit_g.pth`` weights map
onto it key for key.
"""
from __future__ import annotations

from typing import Literal

import torch

from lavis_ds.common import registry as reg
from lavis_ds.common.imports import import_without
from lavis_ds.models.base import BaseModel
from lavis_ds.models.pretrained import load_eva_vit

# timm without wandb, which its summary helper imports when installed (lavis_ds.common.imports)
Eva = import_without("timm.models.eva", ("wandb",)).Eva

Precision = Literal["fp32", "fp16", "bf16"]
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@reg.models.register("eva_vit_g")
class EvaViT(BaseModel, Eva):
    """EVA ViT as BLIP-2 uses it: features of every token after the last block, no final norm.

    EVA specifics, all timm ``Eva`` options: q/v bias with a zero k bias
    (``qkv_bias=True``), absolute position embedding, no RoPE, no layer scale,
    GELU MLP, LayerNorm eps 1e-6 (timm's default). No head, no pooling and no
    final norm: BLIP-2 applies its own ``ln_vision`` to this output.
    """

    PRETRAINED_MODEL_CONFIG_DICT = {
        "eva_vit_g": "models/eva_vit_g/eva_vit_g.yaml",
        "eva_clip_g": "models/eva_vit_g/eva_vit_g.yaml",  # the name LAVIS / MiniGPT4Qwen configs use
        "tiny": "models/eva_vit_g/tiny.yaml",
    }

    def __init__(
        self,
        *,
        img_size: int = 224,
        patch_size: int = 14,
        embed_dim: int = 1408,
        depth: int = 39,
        num_heads: int = 16,
        mlp_ratio: float = 4.3637,
        drop_path_rate: float = 0.0,
        use_grad_checkpoint: bool = False,
        precision: Precision = "fp32",
    ):
        """
        Args:
            img_size: Square input size; the position embedding has one entry per patch plus CLS.
            patch_size: Patch side in pixels.
            embed_dim: Token width (1408 for ViT-g).
            depth: Blocks built. EVA-ViT-G has 40; BLIP-2 uses the first 39.
            num_heads: Attention heads.
            mlp_ratio: MLP hidden / width (4.3637 gives 6144 for width 1408).
            drop_path_rate: Stochastic depth, linearly increasing over the blocks.
            use_grad_checkpoint: Recompute block activations in backward (timm grad checkpointing).
            precision: Parameter dtype. LAVIS keeps the frozen tower in fp16 to save memory.
        """
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}")
        super().__init__(
            img_size=img_size,
            patch_size=patch_size,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            drop_path_rate=drop_path_rate,
            qkv_bias=True,
            num_classes=0,
            global_pool="",
            use_fc_norm=False,
            use_post_transformer_norm=False,
            use_abs_pos_emb=True,
            use_rot_pos_emb=False,
            init_values=None,
        )
        self.set_grad_checkpointing(use_grad_checkpoint)
        self.to(DTYPES[precision])

    def load_from_pretrained(self, path: str) -> None:
        """Load LAVIS's ``eva_vit_g.pth`` (EVA key layout); blocks beyond ``depth`` are skipped and the
        position embedding is interpolated to ``img_size``. The parameters keep ``precision``."""
        load_eva_vit(self, path)

    def forward(self, image: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``image [B, 3, H, W]`` -> token features ``[B, 1 + num_patches, num_features]`` (CLS first)."""
        dtype = self.patch_embed.proj.weight.dtype
        # DeepSpeed casts parameters but not buffers: timm's zero k-bias buffer would stay fp32
        # and turn the concatenated qkv bias fp32 under a bf16/fp16 engine.
        for block in self.blocks:
            k_bias = getattr(block.attn, "k_bias", None)
            if k_bias is not None and k_bias.dtype != dtype:
                block.attn.k_bias = k_bias.to(dtype)
        # The tower may be fp16 while the data loader gives fp32 images.
        return self.forward_features(image.to(dtype))
