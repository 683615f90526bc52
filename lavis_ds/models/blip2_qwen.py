"""BLIP2-Qwen (the MiniGPT4Qwen recipe): EVA-ViT -> ln_vision -> Q-Former -> Linear -> chat LLM.

The LLM is Qwen2.5 by default and any transformers causal LM on request
(``lavis_ds.models.llm_families``). The projected query outputs replace the embeddings
of the image placeholder tokens in a prompt rendered by the tokenizer's chat template
(see ``lavis_ds.models.prompt``); the loss covers the assistant's answers only.
Attribute names follow MiniGPT4Qwen (``visual_encoder``,
``ln_vision``, ``query_tokens``, ``llm_proj``, ``llm_model``) so its trainable-part
checkpoints keep their keys; the Q-Former is Hugging Face's (``qformer``).

The LLM side (tokenizer, LLM, LoRA, prompt, batch, splice, loss, generate) is ``VisionLLM``'s; this class
holds only the image path: the ViT, ``ln_vision``, the Q-Former, its queries and the projection.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Mapping

import torch
from torch import nn
from transformers import Blip2QFormerConfig, Blip2QFormerModel

from lavis_ds.common import registry as reg
from lavis_ds.models.connectors.qformer import FP32LayerNorm  # ln_vision: statistics in fp32 (LAVIS's)
from lavis_ds.models.eva_vit import EvaViT, Precision
from lavis_ds.models import flops
from lavis_ds.models.pretrained import load_blip2
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.processors.image import ImageProcessing

logger = logging.getLogger(__name__)

# The ViT presets by name; a Literal so that the config validator catches a misspelt `vit_model`.
VitPreset = Literal[tuple(EvaViT.PRETRAINED_MODEL_CONFIG_DICT)]  # type: ignore[valid-type]
# ViT settings that have their own top-level key (MiniGPT4Qwen's names); `vit:` must not repeat them.
VIT_KEYS_SET_AT_TOP_LEVEL = {"img_size": "image_size", "drop_path_rate": "drop_path_rate",
                             "use_grad_checkpoint": "use_grad_checkpoint", "precision": "vit_precision",
                             "pretrained": "vit_pretrained", "load_pretrained": "vit_pretrained"}


@reg.models.register("blip2_qwen")
class Blip2Qwen(VisionLLM):
    """BLIP-2 vision tower and Q-Former bridged into a chat LLM (Qwen2.5 by default) by one linear projection."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "qwen2.5_7b_instruct": "models/blip2_qwen/qwen2.5_7b_instruct.yaml",
        "qwen2.5_1.5b_instruct": "models/blip2_qwen/qwen2.5_1.5b_instruct.yaml",
        "qwen3_8b": "models/blip2_qwen/qwen3_8b.yaml",
        "qwen3_1.7b": "models/blip2_qwen/qwen3_1.7b.yaml",
        "llama3.1_8b_instruct": "models/blip2_qwen/llama3.1_8b_instruct.yaml",
        "llama3.2_3b_instruct": "models/blip2_qwen/llama3.2_3b_instruct.yaml",
        "llama3.2_1b_instruct": "models/blip2_qwen/llama3.2_1b_instruct.yaml",
        "tiny": "models/blip2_qwen/tiny.yaml",
    }
    # Nested dict keys and the class whose arguments they are: the config validator checks them too
    # (`llm_config` is not listed: transformers configs take extra keys on purpose).
    NESTED_SCHEMAS = {"qformer": Blip2QFormerConfig, "vit": EvaViT}
    # MiniGPT4Qwen's (Coobiw/MPP-LLaVA) model_types: Qwen-1 chat models, tiktoken tokenizer and remote code.
    _QWEN1 = "it is MiniGPT4Qwen's Qwen-1 chat model (tiktoken tokenizer, remote code), which lavis_ds does not load"
    REPLACED_MODEL_TYPES = {
        "qwen7b_chat": ("qwen2.5_7b_instruct", _QWEN1),
        "qwen14b_chat": ("qwen2.5_7b_instruct", _QWEN1),
        "qwen1.8b_chat": ("qwen2.5_1.5b_instruct", _QWEN1),
    }
    FILE_KEYS = (*VisionLLM.FILE_KEYS, "vit_pretrained")  # loaded whatever load_pretrained says, as LAVIS does
    CONNECTOR_PREFIXES = ("llm_proj.",)

    # Over 50 lines: most of it is the keyword list, the model section's schema (read from the signature).
    def __init__(
        self,
        *,
        vit_model: VitPreset = "eva_vit_g",
        vit: dict[str, Any] | None = None,
        image_size: int = 224,
        drop_path_rate: float = 0.0,
        use_grad_checkpoint: bool = False,
        vit_precision: Precision = "fp16",
        vit_pretrained: str | None = None,
        freeze_vit: bool = True,
        unfreeze_pos_embed: bool = False,
        num_query_token: int = 32,
        qformer: dict[str, Any] | None = None,
        freeze_qformer: bool = True,
        freeze_queries: bool = True,
        freeze_proj: bool = False,
        **llm_args: Any,
    ):
        """
        Args:
            vit_model: Preset (model_type of ``eva_vit_g``) giving the ViT sizes: ``eva_vit_g``
                (alias ``eva_clip_g``) or ``tiny``.
            vit: Overrides of that preset's ``EvaViT`` arguments (not the four set below).
            image_size: Input image side; sets the ViT's ``img_size``.
            drop_path_rate: ViT stochastic depth.
            use_grad_checkpoint: Gradient checkpointing in the ViT blocks.
            vit_precision: ViT parameter dtype (LAVIS keeps the frozen tower in fp16).
            vit_pretrained: LAVIS ``eva_vit_g.pth`` to load into the ViT, whatever ``load_pretrained``
                says (LAVIS always loads it). ``pretrained`` (a BLIP-2 checkpoint) is loaded after it
                and wins for the ViT if it holds ViT weights too.
            freeze_vit: Freeze the ViT (kept in eval mode).
            unfreeze_pos_embed: With ``freeze_vit``, still train the ViT position embedding.
            num_query_token: Q-Former queries = image placeholder tokens in the prompt.
            qformer: ``Blip2QFormerConfig`` arguments; defaults are BLIP-2's (768 wide, 12 layers).
                ``encoder_hidden_size`` is the ViT width.
            freeze_qformer: Freeze the Q-Former and ``ln_vision``.
            freeze_queries: Freeze the query tokens.
            freeze_proj: Freeze the Q-Former -> LLM projection.
            **llm_args: The LLM side's arguments (``VisionLLM``: ``llm_model``, ``tokenizer``, ``get_lora``,
                ``max_txt_len``, ...).
        """
        super().__init__(**llm_args)
        self.image_size = image_size
        self.tokens_per_image = num_query_token
        self.visual_encoder = self._build_vit(vit_model, vit, image_size, drop_path_rate,
                                              use_grad_checkpoint, vit_precision, vit_pretrained)
        self.vit_pretrained = vit_pretrained
        vit_width = self.visual_encoder.num_features
        self.ln_vision = FP32LayerNorm(vit_width)

        qformer_kwargs = dict(qformer or {})
        if qformer_kwargs.setdefault("encoder_hidden_size", vit_width) != vit_width:
            raise ValueError(f"qformer.encoder_hidden_size={qformer_kwargs['encoder_hidden_size']} "
                             f"must equal the ViT width {vit_width} (or be left out)")
        self.qformer = Blip2QFormerModel(Blip2QFormerConfig(**qformer_kwargs))
        qformer_width = self.qformer.config.hidden_size
        self.query_tokens = nn.Parameter(torch.zeros(1, num_query_token, qformer_width))
        # BLIP-2 initialises the queries like BERT weights.
        nn.init.normal_(self.query_tokens, std=self.qformer.config.initializer_range)

        llm_hidden = self.build_llm()
        self.llm_proj = nn.Linear(qformer_width, llm_hidden)
        self._freeze_image_path(freeze_vit, unfreeze_pos_embed, freeze_qformer, freeze_queries, freeze_proj)
        self.finish_build()

    @classmethod
    def config_problems(cls, section: Mapping[str, Any]) -> list[str]:
        """What the constructor would refuse, found before anything is built (same rules as below)."""
        clashes = sorted(k for k in (section.get("vit") or {}) if k in VIT_KEYS_SET_AT_TOP_LEVEL)
        problems = [f"model.vit.{k}: set it with model.{VIT_KEYS_SET_AT_TOP_LEVEL[k]}, not under vit" for k in clashes]
        return problems + super().config_problems(section)

    @classmethod
    def tokens_per_image_of(cls, section: Mapping[str, Any]) -> int:
        """One placeholder per Q-Former query: ``num_query_token``."""
        return cls.settings_of(section)["num_query_token"]

    @classmethod
    def image_processing_of(cls, section: Mapping[str, Any]) -> ImageProcessing:
        """EVA-CLIP's: a square bicubic resize to ``image_size`` and CLIP's mean/std (what ``blip2_image_eval``
        does; a ``tower_image_*`` processor is filled with it)."""
        return ImageProcessing(cls.settings_of(section)["image_size"])

    def vision_blocks(self) -> list[nn.Module]:
        """The ViT blocks and the Q-Former layers."""
        return [*self.visual_encoder.blocks, *self.qformer.encoder.layer]

    # ----------------------------------------------------------------- building
    @staticmethod
    def _build_vit(vit_model: str, vit: dict[str, Any] | None, image_size: int, drop_path_rate: float,
                   use_grad_checkpoint: bool, vit_precision: str, vit_pretrained: str | None) -> EvaViT:
        overrides = dict(vit or {})
        clashes = sorted(k for k in overrides if k in VIT_KEYS_SET_AT_TOP_LEVEL)
        if clashes:
            raise ValueError("set these with their top-level model keys, not under `vit:`: " +
                             ", ".join(f"vit.{k} -> {VIT_KEYS_SET_AT_TOP_LEVEL[k]}" for k in clashes))
        cfg = EvaViT.default_config(vit_model)
        cfg.update(overrides)
        cfg.update(img_size=image_size, drop_path_rate=drop_path_rate,
                   use_grad_checkpoint=use_grad_checkpoint, precision=vit_precision,
                   load_pretrained=vit_pretrained is not None, pretrained=vit_pretrained)
        return EvaViT.from_config(cfg)

    def load_from_pretrained(self, path: str) -> None:
        """Load a BLIP-2 checkpoint (``pretrained``): a LAVIS ``.pth`` or a Hugging Face BLIP-2 folder.

        Sets ``ln_vision``, ``qformer``, ``query_tokens`` and, if the file has them, the ViT.
        See ``lavis_ds.models.pretrained`` for the key mapping and the keys skipped on purpose.
        """
        load_blip2(self, path, vit_loaded=self.vit_pretrained is not None)

    def _freeze_image_path(self, freeze_vit: bool, unfreeze_pos_embed: bool, freeze_qformer: bool,
                           freeze_queries: bool, freeze_proj: bool) -> None:
        if freeze_vit:
            self.freeze_module("visual_encoder")
            if unfreeze_pos_embed:
                self.visual_encoder.pos_embed.requires_grad_(True)
        elif unfreeze_pos_embed:
            logger.info("unfreeze_pos_embed has no effect: the whole ViT trains (freeze_vit=false)")
        if freeze_qformer:
            self.freeze_module("qformer")
            self.freeze_module("ln_vision")
        if freeze_queries:
            self.query_tokens.requires_grad_(False)
        if freeze_proj:
            self.freeze_module("llm_proj")

    def image_path_flops(self) -> tuple[flops.Flops, Callable[[int], flops.Flops], bool]:
        """The EVA-ViT as the tower; ``ln_vision``, the Q-Former, its queries and ``llm_proj`` as the connector."""
        tower, connector = flops.Tally(), flops.Tally()
        features_grad = flops.eva_vit(self.visual_encoder, tower)
        image_grad = flops.qformer(self.qformer, self.query_tokens, self.ln_vision, self.llm_proj,
                                   flops.eva_vit_tokens(self.visual_encoder), features_grad, connector)
        return tower.flops(), lambda text_tokens: connector.flops(), image_grad

    # ----------------------------------------------------------------- the image path
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """``image [B, 3, H, W]`` -> projected queries ``[B, num_query_token, llm_hidden]`` in the LLM embedding dtype."""
        features = self.ln_vision(self.visual_encoder(image))
        queries = self.query_tokens.expand(features.shape[0], -1, -1)
        mask = torch.ones(features.shape[:-1], dtype=torch.long, device=features.device)
        # The HF Q-Former casts queries and features to its own dtype.
        query_out = self.qformer(query_embeds=queries, encoder_hidden_states=features,
                                 encoder_attention_mask=mask).last_hidden_state
        projected = self.llm_proj(query_out.to(self.llm_proj.weight.dtype))
        return projected.to(self._embedding_dtype())

    def encode_images(self, images: torch.Tensor, samples: dict[str, Any]) -> torch.Tensor:
        """BLIP-2 reads the images alone (``encode_image``)."""
        return self.encode_image(images)


# MiniGPT4Qwen's name for the same architecture (Coobiw/MPP-LLaVA: `arch: minigpt4qwen`).
reg.models.register_alias("minigpt4qwen", "blip2_qwen")
