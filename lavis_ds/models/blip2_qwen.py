"""BLIP2-Qwen (the MiniGPT4Qwen recipe): the ``eva_vit_g`` tower and the ``qformer`` connector into a chat LLM.

The image path is the registered parts, composed as every architecture composes them
(``lavis_ds.models.vision_llm``): ``vision_tower`` (EVA-ViT-g) -> ``connector`` (``ln_vision``, BLIP-2's Q-Former
with its queries, a linear projection into the LLM). The LLM is Qwen2.5 by default and any transformers causal LM
on request (``lavis_ds.models.llm_families``).

Its ``model:`` section keeps MiniGPT4Qwen's flat keys (``vit_model``, ``image_size``, ``vit_precision``,
``freeze_vit``, ``num_query_token``, ``qformer``, ...): its settings (``lavis_ds.models.settings.blip2_qwen``) turn
them into the two parts' sections, the one place they are read. Checkpoints written while blip2_qwen held those
parts as flat attributes (``visual_encoder.*``, ``ln_vision.*``, ``qformer.*``, ``query_tokens``, ``llm_proj.*``)
load through ``RENAMED_KEYS``; ``pretrained`` takes a LAVIS BLIP-2 ``.pth`` or a Hugging Face BLIP-2 folder (its
image path only, ``lavis_ds.models.pretrained.load_blip2``).
"""
from __future__ import annotations

from typing import Any, Literal

from lavis_ds.common import registry as reg
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.models.eva_vit import EvaViT, Precision
from lavis_ds.models.pretrained import load_blip2
from lavis_ds.models.settings.blip2_qwen import FLAT_KEYS, Blip2QwenSettings, part_sections_of, refused_keys

# The ViT presets by name; a Literal so that the config validator catches a misspelt `vit_model`.
VitPreset = Literal[tuple(EvaViT.PRETRAINED_MODEL_CONFIG_DICT)]  # type: ignore[valid-type]


@reg.models.register("blip2_qwen")
class Blip2Qwen(VisionLLM):
    """BLIP-2's EVA-ViT-g and Q-Former bridged into a chat LLM (Qwen2.5 by default) by one linear projection."""

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
    SETTINGS = Blip2QwenSettings
    # The flat attributes' parameter names (MiniGPT4Qwen's) -> the parts'; checkpoints saved with them load.
    RENAMED_KEYS = (("visual_encoder.", "vision_tower.vit."), ("ln_vision.", "connector.ln_vision."),
                    ("qformer.", "connector.qformer."), ("query_tokens", "connector.query_tokens"),
                    ("llm_proj.", "connector.llm_proj."))

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
        arguments = locals()  # outside the comprehension, whose own scope locals() would read
        flat = {key: arguments[key] for key in FLAT_KEYS}
        # what the config check reports, in its words
        refused = refused_keys({**flat, **{k: llm_args[k] for k in ("vision_tower", "connector") if k in llm_args}})
        if refused:
            raise ValueError("; ".join(refused))
        tower, connector = part_sections_of(flat)
        super().__init__(vision_tower=tower, connector=connector, **llm_args)
        self.vit_pretrained = vit_pretrained

    def load_from_pretrained(self, path: str) -> None:
        """Load a BLIP-2 checkpoint (``pretrained``): a LAVIS ``.pth`` or a Hugging Face BLIP-2 folder.

        Sets ``ln_vision``, the Q-Former, its queries and, if the file has them, the ViT.
        See ``lavis_ds.models.pretrained`` for the key mapping and the keys skipped on purpose.
        """
        load_blip2(self, path, vit_loaded=self.vit_pretrained is not None)


# MiniGPT4Qwen's name for the same architecture (Coobiw/MPP-LLaVA: `arch: minigpt4qwen`).
reg.models.register_alias("minigpt4qwen", "blip2_qwen")
