"""CLIP and SigLIP towers: transformers' ``CLIPVisionModel`` / ``SiglipVisionModel`` with LLaVA's feature selection.

The features are exactly what transformers' ``LlavaModel.get_image_features`` feeds its projector:
``vision_feature_layer`` picks hidden states (an int, or a list whose picks are concatenated on the channel
axis), and ``vision_feature_select_strategy: default`` drops the first token of each (CLIP's CLS).
SigLIP has no CLS token; transformers drops the first token under ``default`` all the same (it drops
a patch), so the SigLIP presets say ``full``, as transformers' SigLIP-tower LLaVA configs do.

A published folder is read as ``CLIPVisionModel.from_pretrained`` reads it: a full CLIPModel folder
(``openai/clip-vit-large-patch14-336``) or a vision-only one; its ``config.json`` gives the architecture.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

from lavis_ds.common import registry as reg, safe_files
from lavis_ds.common.registry import vision_towers
from lavis_ds.models.flops import Flops, Tally, attention_pooling, hf_vision_encoder
from lavis_ds.models.hf.family import family_of_model_type, folder_model_type
from lavis_ds.models.parts import PartError, read_safetensors
from lavis_ds.models.towers.base import CLIP_STD, CLIP_MEAN, ImageProcessing, VisionTower

logger = logging.getLogger(__name__)

# config.json model_type -> the tower that reads it, to name the right tower when a folder does not fit.
TOWER_OF_MODEL_TYPE = {"clip": "clip", "clip_vision_model": "clip", "siglip": "siglip",
                       "siglip_vision_model": "siglip", "blip-2": "eva_vit_g", "instructblip": "eva_vit_g",
                       "blip_2_vision_model": "eva_vit_g", "instructblip_vision_model": "eva_vit_g"}


def select_features(hidden_states: tuple[torch.Tensor, ...], layers: int | list[int], strategy: str) -> torch.Tensor:
    """LLaVA's feature selection over ``hidden_states`` (embeddings output first, then one per layer)."""
    picked = [hidden_states[layers]] if isinstance(layers, int) else [hidden_states[i] for i in layers]
    if strategy == "default":
        picked = [h[:, 1:] for h in picked]
    return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)


class HfVisionTower(VisionTower):
    """A transformers vision model as a tower; subclasses name the classes, presets and processing (data only)."""

    CONFIG_CLASS: type
    MODEL_CLASS: type
    MODEL_TYPES: tuple[str, ...]  # config.json model_types this tower reads (full model, vision model)
    PRESETS: dict[str, dict[str, Any]]  # name -> config arguments (+ "hub_id": the published folder)
    HAS_CLS = True
    MEAN, STD, RESIZE = CLIP_MEAN, CLIP_STD, "shortest_edge"

    def __init__(self, *, preset: str, vision_config: dict[str, Any] | None = None, image_size: int | None = None,
                 vision_feature_layer: int | list[int] = -2,
                 vision_feature_select_strategy: Literal["default", "full"] = "default",
                 pad_to_square: bool = False):
        """
        Args:
            preset: Architecture by name (``PRESETS``); ``vision_config`` overrides its keys. A published
                folder (``pretrained``) replaces both with its own config.json.
            vision_config: Arguments of the transformers vision config (``hidden_size``, ``image_size``, ...).
            image_size: Must equal the architecture's ``image_size`` (the position embedding is learned for
                it); left out, it is that size.
            vision_feature_layer: Hidden state(s) to use: ``-2`` is the penultimate layer's output (LLaVA-1.5);
                a list concatenates several on the channel axis.
            vision_feature_select_strategy: ``default`` drops the first token, ``full`` keeps all.
            pad_to_square: Pad images to a square with the mean colour before resizing (LLaVA-1.5).
        """
        super().__init__()
        if preset not in self.PRESETS:
            raise PartError(f"unknown {self.tower_name()} preset {preset!r}; presets: {', '.join(self.PRESETS)}")
        arguments = {k: v for k, v in self.PRESETS[preset].items() if k != "hub_id"}
        config = self.CONFIG_CLASS(**{**arguments, **(vision_config or {})})
        if image_size is not None and image_size != config.image_size:
            raise PartError(f"vision_tower.image_size: {image_size} is a size the {self.tower_name()} tower cannot "
                            f"take; it takes {config.image_size} only (its position embedding has "
                            f"{config.image_size // config.patch_size}x{config.image_size // config.patch_size} "
                            f"patches of {config.patch_size} px): set image_size: {config.image_size} or leave it out")
        self.layers = self._check_layers(vision_feature_layer, config.num_hidden_layers)
        if vision_feature_select_strategy not in ("default", "full"):
            raise PartError(f"vision_tower.vision_feature_select_strategy: {vision_feature_select_strategy!r}; "
                            "valid: default (drop the first token), full")
        if vision_feature_select_strategy == "default" and not self.HAS_CLS:
            logger.warning("%s has no CLS token: vision_feature_select_strategy 'default' drops its first patch "
                           "(as transformers' LLaVA does); 'full' keeps every patch", self.tower_name())
        self.strategy = vision_feature_select_strategy
        self.model = self.MODEL_CLASS(config)
        self.image_size = config.image_size
        grid = (config.image_size // config.patch_size) ** 2
        self.num_tokens = grid + int(self.HAS_CLS) - int(vision_feature_select_strategy == "default")
        self.num_features = config.hidden_size * (1 if isinstance(self.layers, int) else len(self.layers))
        self.processing = ImageProcessing(self.image_size, self.MEAN, self.STD, self.RESIZE, pad_to_square)
        self._freeze_unused(config.num_hidden_layers)

    @classmethod
    def tower_name(cls) -> str:
        return next(name for name in vision_towers if vision_towers.get(name) is cls)

    @staticmethod
    def _check_layers(layers: int | list[int], depth: int) -> int | list[int]:
        picks = [layers] if isinstance(layers, int) else list(layers)
        bad = [i for i in picks if isinstance(i, bool) or not isinstance(i, int) or not -(depth + 1) <= i <= depth]
        if not picks or bad:
            raise PartError(f"vision_tower.vision_feature_layer: {layers!r}; valid: an int or a non-empty list of "
                            f"ints from {-(depth + 1)} to {depth} (0 is the embeddings, {depth} or -1 the last of "
                            f"{depth} layers)")
        return layers if isinstance(layers, int) else picks

    def _freeze_unused(self, depth: int) -> None:
        """Parameters that no selected feature depends on never get a gradient: the layers past the deepest
        pick, the final norm (LLaVA reads hidden states, which precede it) and SigLIP's pooling head. They stay
        in the state dict (an export writes the whole tower) but never train, or engines that expect every
        trainable parameter to get a gradient would wait for them."""
        picks = [self.layers] if isinstance(self.layers, int) else self.layers
        deepest = max(i % (depth + 1) for i in picks)
        unused = [*self.encoder_layers()[deepest:], self.model.post_layernorm, getattr(self.model, "head", None)]
        for module in unused:
            if module is not None:
                module.requires_grad_(False)

    def encoder_layers(self) -> nn.ModuleList:
        inner = getattr(self.model, "vision_model", self.model)  # older transformers wrap it once more
        return inner.encoder.layers

    def blocks(self) -> list[nn.Module]:
        return list(self.encoder_layers())

    def flops(self) -> tuple[Flops, bool]:
        """The encoder up to the deepest selected hidden state trains by the rule; the layers past it, the final
        norm and SigLIP's pooling head run forward only (nothing reads them)."""
        inner = getattr(self.model, "vision_model", self.model)
        depth = len(self.encoder_layers())
        picks = [self.layers] if isinstance(self.layers, int) else self.layers
        used = max(i % (depth + 1) for i in picks)
        tokens = inner.embeddings.num_patches + int(self.HAS_CLS)
        tally, forward_only = Tally(), Tally()
        features_grad = hf_vision_encoder(inner.embeddings, getattr(inner, "pre_layrnorm", None),
                                          list(self.encoder_layers()), used, tokens, tally, forward_only)
        if getattr(inner, "head", None) is not None:
            attention_pooling(inner.head, tokens, forward_only)
        return tally.flops() + Flops(forward_only.forward, forward_only.forward), features_grad

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        out = self.model(images.to(dtype), output_hidden_states=True, return_dict=True)
        return select_features(out.hidden_states, self.layers, self.strategy)

    @classmethod
    def from_folder(cls, folder: str, section: Mapping[str, Any], path: str) -> "HfVisionTower":
        """The architecture of a published folder, whose config.json must be of this tower's model type."""
        config_file = Path(folder).expanduser() / "config.json"
        if not config_file.is_file():
            raise PartError(f"{path}.pretrained: {folder} has no config.json; expected a transformers "
                            f"{cls.MODEL_CLASS.__name__} (or full model) folder such as {cls._hub_example()}")
        family = family_of_model_type(folder_model_type(folder))
        if family is not None:  # a vision-LLM folder (LlavaForConditionalGeneration, ...): its tower's config
            config = family.folders.tower_config(Path(folder).expanduser())
            model_type = config.model_type
        else:
            config, model_type = None, folder_model_type(folder)
        if model_type not in cls.MODEL_TYPES:
            other = TOWER_OF_MODEL_TYPE.get(model_type)
            hint = f"; for this folder use vision tower {other!r}" if other else ""
            raise PartError(f"{path}.pretrained: {config_file} has model_type {model_type!r}, but the "
                            f"{cls.tower_name()} tower reads model_type {' or '.join(map(repr, cls.MODEL_TYPES))} "
                            f"(a folder such as {cls._hub_example()}){hint}")
        config = config or cls.CONFIG_CLASS.from_pretrained(folder)  # a full model's config yields its vision_config
        own = {k: v for k, v in config.to_dict().items() if k in cls.CONFIG_CLASS().to_dict()}
        if section.get("vision_config"):
            logger.info("%s.vision_config is ignored: the architecture comes from %s", path, config_file)
        return cls(**{**section, "vision_config": own, "preset": section.get("preset", next(iter(cls.PRESETS)))})

    def load_pretrained(self, path: str) -> None:
        """Weights of a published folder, read as ``MODEL_CLASS.from_pretrained`` does (safetensors or .bin,
        sharded or not, a full CLIP/SigLIP model's text half left out), or the tower of a
        ``LlavaForConditionalGeneration`` folder (any of its layouts); every tower weight must be there."""
        folder = Path(path).expanduser()
        family = family_of_model_type(folder_model_type(folder))
        if family is not None:  # a vision-LLM folder: the tower's keys as its family lays them out
            from lavis_ds.models import hf_keys

            state = read_safetensors(folder, lambda key: key.startswith(family.folders.tower_prefixes),
                                     "vision_tower.pretrained")
            ours = hf_keys.hf_vision_keys(family.folders.tower_state(state), self.model)
            own = self.model.state_dict().keys()
            missing, unexpected = sorted(own - ours.keys()), sorted(ours.keys() - own)
            if missing or unexpected:
                raise PartError(f"{path}: its vision tower does not fit the {self.tower_name()} tower: missing "
                                f"{missing[:5]}, unexpected {unexpected[:5]}")
            self.model.load_state_dict(ours, strict=True)
            return
        with safe_files.library_reads(folder):  # a .bin weights file is a pickle: refused by name if unsafe
            loaded, info = self.MODEL_CLASS.from_pretrained(path, config=self.model.config, output_loading_info=True,
                                                            dtype=next(self.model.parameters()).dtype)
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise PartError(f"{path}: {len(missing)} weight(s) of the {self.tower_name()} tower are not in the "
                            f"folder: {', '.join(missing[:5])}")
        with torch.no_grad():
            self.model.load_state_dict(loaded.state_dict(), strict=True)

    @classmethod
    def _hub_example(cls) -> str:
        return next(p["hub_id"] for p in cls.PRESETS.values() if "hub_id" in p)


@reg.vision_towers.register("clip")
class ClipTower(HfVisionTower):
    """CLIP ViT (``CLIPVisionModel``); LLaVA-1.5 uses ViT-L/14-336, penultimate layer, CLS dropped."""

    CONFIG_CLASS, MODEL_CLASS = CLIPVisionConfig, CLIPVisionModel
    MODEL_TYPES = ("clip", "clip_vision_model")
    PRESETS = {
        "vit_l_14_336": dict(hub_id="openai/clip-vit-large-patch14-336", hidden_size=1024, intermediate_size=4096,
                             num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                             projection_dim=768, hidden_act="quick_gelu"),
        "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
                     patch_size=14, hidden_act="quick_gelu"),
    }

    def __init__(self, *, preset: Literal["vit_l_14_336", "tiny"] = "vit_l_14_336", **kwargs: Any):
        super().__init__(preset=preset, **kwargs)


@reg.vision_towers.register("siglip")
class SiglipTower(HfVisionTower):
    """SigLIP ViT (``SiglipVisionModel``): no CLS token, so its presets keep every patch (``full``)."""

    CONFIG_CLASS, MODEL_CLASS = SiglipVisionConfig, SiglipVisionModel
    MODEL_TYPES = ("siglip", "siglip_vision_model")
    HAS_CLS = False
    MEAN, STD, RESIZE = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "squash"
    PRESETS = {
        "so400m_14_384": dict(hub_id="google/siglip-so400m-patch14-384", hidden_size=1152, intermediate_size=4304,
                              num_hidden_layers=27, num_attention_heads=16, image_size=384, patch_size=14),
        "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
                     patch_size=14),
    }

    def __init__(self, *, preset: Literal["so400m_14_384", "tiny"] = "so400m_14_384",
                 vision_feature_layer: int | list[int] = -1,
                 vision_feature_select_strategy: Literal["default", "full"] = "full", **kwargs: Any):
        super().__init__(preset=preset, vision_feature_layer=vision_feature_layer,
                         vision_feature_select_strategy=vision_feature_select_strategy, **kwargs)
