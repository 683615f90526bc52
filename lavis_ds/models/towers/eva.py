"""BLIP-2's EVA-ViT-g as a tower: lavis_ds's timm-based :class:`~lavis_ds.models.eva_vit.EvaViT`, held, not copied.

Its output is every token after the last block, CLS first and without a final norm: what BLIP-2 feeds
its Q-Former (whose connector applies ``ln_vision``). Published weights: LAVIS's ``eva_vit_g.pth``, or the
``vision_model`` of a Hugging Face BLIP-2 / InstructBLIP folder (renamed by ``models.hf_keys``).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.eva_vit import EvaViT, Precision
from lavis_ds.models.flops import Flops, Tally, eva_vit
from lavis_ds.models.parts import PartError
from lavis_ds.models.pretrained import load_checked, load_eva_vit
from lavis_ds.models.towers.base import ImageProcessing, VisionTower


@reg.vision_towers.register("eva_vit_g")
class EvaTower(VisionTower):
    """EVA-ViT-g/14 (39 of 40 blocks, 1408 wide) as BLIP-2 and InstructBLIP use it; ``tiny`` for tests."""

    def __init__(self, *, preset: Literal["eva_vit_g", "tiny"] = "eva_vit_g", vit: dict[str, Any] | None = None,
                 image_size: int | None = None, drop_path_rate: float = 0.0, use_grad_checkpoint: bool = False,
                 precision: Precision = "fp32", unfreeze_pos_embed: bool = False):
        """
        Args:
            preset: ``EvaViT`` preset (its YAML under ``configs/models/eva_vit_g``).
            vit: Overrides of the preset's ``EvaViT`` arguments (``depth``, ``embed_dim``, ...).
            image_size: Input side (default: the preset's); published weights' position embedding is
                interpolated to it.
            drop_path_rate: Stochastic depth.
            use_grad_checkpoint: Recompute block activations in backward.
            precision: Parameter dtype (LAVIS keeps the frozen tower in fp16).
            unfreeze_pos_embed: With ``freeze``, still train the position embedding (MiniGPT4Qwen's option).
        """
        super().__init__()
        arguments = {k: v for k, v in EvaViT.default_config(preset).items() if k not in ("arch", "model_type")}
        arguments.update(vit or {})
        image_size = image_size or arguments["img_size"]
        if image_size % arguments["patch_size"]:
            patch = arguments["patch_size"]
            raise PartError(f"vision_tower.image_size: {image_size} is a size the eva_vit_g tower cannot take; it "
                            f"takes multiples of its patch size {patch} (e.g. {image_size // patch * patch or patch}), "
                            "its position embedding interpolated to the grid")
        arguments.update(img_size=image_size, drop_path_rate=drop_path_rate, use_grad_checkpoint=use_grad_checkpoint,
                         precision=precision)
        self.vit = EvaViT(**arguments)
        self.image_size = image_size
        self.num_features = self.vit.num_features
        self.num_tokens = self.vit.patch_embed.num_patches + 1  # CLS first, as BLIP-2's Q-Former reads them
        # BLIP-2's eval processing: a square bicubic resize and CLIP's statistics (EVA-CLIP trained with them).
        self.processing = ImageProcessing(image_size)
        self.unfreeze_pos_embed = unfreeze_pos_embed

    def freeze_submodule(self, name: str = "") -> None:
        """Freeze ``name`` (``""``: the whole tower), the position embedding excepted with ``unfreeze_pos_embed``."""
        super().freeze_submodule(name)
        if self.unfreeze_pos_embed:
            self.vit.pos_embed.requires_grad_(True)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vit(images)

    def blocks(self) -> list[nn.Module]:
        return list(self.vit.blocks)

    def flops(self) -> tuple[Flops, bool]:
        tally = Tally()
        features_grad = eva_vit(self.vit, tally)
        return tally.flops(), features_grad

    def load_pretrained(self, path: str) -> None:
        """LAVIS's ``eva_vit_g.pth``, the ``visual_encoder`` of a LAVIS BLIP-2 / InstructBLIP ``.pth``, or the
        ``vision_model`` of a Hugging Face BLIP-2 / InstructBLIP folder; checked key for key."""
        from lavis_ds.models import hf_keys
        from lavis_ds.models.pretrained import HF_BLIP2, LAVIS_BLIP2, CheckpointError, read_checkpoint

        # Format (``pretrained.read_checkpoint``) -> its ViT keys as EvaViT's; LAVIS's eva_vit_g.pth is the ViT alone,
        # read whole by ``load_eva_vit``.
        vit_keys = {HF_BLIP2: hf_keys.eva_from_hf, LAVIS_BLIP2: hf_keys.eva_from_lavis}
        fmt, state, _ = read_checkpoint(path)
        if fmt not in vit_keys:
            load_eva_vit(self.vit, path)
            return
        ours = vit_keys[fmt](state, self.vit)
        if not ours:
            raise PartError(f"vision_tower.pretrained: {path} holds no ViT weights (LAVIS saves only trained "
                            "parameters, and BLIP-2 freezes its ViT): give LAVIS's eva_vit_g.pth instead")
        try:
            load_checked(self.vit, ours, self.vit.state_dict().keys(), path, fmt)
        except CheckpointError as e:
            raise PartError(str(e)) from None
