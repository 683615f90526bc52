"""BLIP2-Qwen (the MiniGPT4Qwen recipe): the ``eva_vit_g`` tower and the ``qformer`` connector into a chat LLM.

The image path is the registered parts, composed as every architecture composes them
(``lavis_ds.models.composed``): ``vision_tower`` (EVA-ViT-g) -> ``connector`` (``ln_vision``, BLIP-2's Q-Former
with its queries, a linear projection into the LLM). The LLM is Qwen2.5 by default and any transformers causal LM
on request (``lavis_ds.models.llm_families``).

Its ``model:`` section keeps MiniGPT4Qwen's flat keys (``vit_model``, ``image_size``, ``vit_precision``,
``freeze_vit``, ``num_query_token``, ``qformer``, ...): :func:`part_sections_of` turns them into the two parts'
sections, the one place they are read. Checkpoints written while blip2_qwen held those parts as flat attributes
(``visual_encoder.*``, ``ln_vision.*``, ``qformer.*``, ``query_tokens``, ``llm_proj.*``) load through
``RENAMED_KEYS``; ``pretrained`` takes a LAVIS BLIP-2 ``.pth`` or a Hugging Face BLIP-2 folder (its image path
only, ``lavis_ds.models.pretrained.load_blip2``).
"""
from __future__ import annotations

from typing import Any, Literal, Mapping

from transformers import Blip2QFormerConfig

from lavis_ds.common import registry as reg
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.models.composed import ComposedVisionLLM
from lavis_ds.models.eva_vit import EvaViT, Precision
from lavis_ds.models.pretrained import load_blip2
from lavis_ds.models.vision_llm import VisionLLM

# The ViT presets by name; a Literal so that the config validator catches a misspelt `vit_model`.
VitPreset = Literal[tuple(EvaViT.PRETRAINED_MODEL_CONFIG_DICT)]  # type: ignore[valid-type]
# ViT settings that have their own top-level key (MiniGPT4Qwen's names); `vit:` must not repeat them.
VIT_KEYS_SET_AT_TOP_LEVEL = {"img_size": "image_size", "drop_path_rate": "drop_path_rate",
                             "use_grad_checkpoint": "use_grad_checkpoint", "precision": "vit_precision",
                             "pretrained": "vit_pretrained", "load_pretrained": "vit_pretrained"}
# Each flat key -> (the part, its key there). `vit_model` names an EvaViT preset; eva_clip_g is LAVIS's name.
FLAT_KEYS = {
    "vit_model": ("vision_tower", "preset"), "vit": ("vision_tower", "vit"),
    "image_size": ("vision_tower", "image_size"), "drop_path_rate": ("vision_tower", "drop_path_rate"),
    "use_grad_checkpoint": ("vision_tower", "use_grad_checkpoint"), "vit_precision": ("vision_tower", "precision"),
    "vit_pretrained": ("vision_tower", "pretrained"), "freeze_vit": ("vision_tower", "freeze"),
    "unfreeze_pos_embed": ("vision_tower", "unfreeze_pos_embed"),
    "num_query_token": ("connector", "num_query_token"), "qformer": ("connector", "qformer"),
    "freeze_qformer": ("connector", "freeze_qformer"), "freeze_queries": ("connector", "freeze_queries"),
    "freeze_proj": ("connector", "freeze_proj"),
}
PRESET_ALIASES = {"eva_clip_g": "eva_vit_g"}


def part_sections_of(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``eva_vit_g`` tower's and the ``qformer`` connector's sections that blip2_qwen's flat keys describe."""
    sections: dict[str, dict[str, Any]] = {"vision_tower": {"name": "eva_vit_g"}, "connector": {"name": "qformer"}}
    for key, (part, part_key) in FLAT_KEYS.items():
        if key in flat:
            sections[part][part_key] = flat[key]
    tower = sections["vision_tower"]
    tower["preset"] = PRESET_ALIASES.get(tower.get("preset"), tower.get("preset"))
    if tower.get("vit") is not None:
        tower["vit"] = {k: v for k, v in tower["vit"].items() if k not in VIT_KEYS_SET_AT_TOP_LEVEL}
    return tower, sections["connector"]


@reg.models.register("blip2_qwen")
class Blip2Qwen(ComposedVisionLLM):
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
    # The flat attributes' parameter names (MiniGPT4Qwen's) -> the parts'; checkpoints saved with them load.
    RENAMED_KEYS = (("visual_encoder.", "vision_tower.vit."), ("ln_vision.", "connector.ln_vision."),
                    ("qformer.", "connector.qformer."), ("query_tokens", "connector.query_tokens"),
                    ("llm_proj.", "connector.llm_proj."))
    FILE_KEYS = (*ComposedVisionLLM.FILE_KEYS, "vit_pretrained")  # loaded whatever load_pretrained says, as LAVIS does
    # The datasets keep their builders' processors (blip2_image_*), as LAVIS's BLIP-2 configs name them.
    IMAGE_PROCESSORS: dict[str, str] = {}

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
        parts = [key for key in ("vision_tower", "connector") if key in llm_args]
        if parts:
            raise ValueError(f"{', '.join(parts)}: blip2_qwen sets its parts with its own keys ({', '.join(FLAT_KEYS)}"
                             "); for other parts use an architecture that takes part sections (arch: llava)")
        check_vit_overrides(vit)
        tower, connector = part_sections_of(flat)
        super().__init__(vision_tower=tower, connector=connector, **llm_args)
        self.vit_pretrained = vit_pretrained

    # ----------------------------------------------------------------- config side (nothing built, no weights)
    @classmethod
    def part_sections(cls, section: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The parts' sections the flat keys give, each key's default where the section leaves it out."""
        return part_sections_of(cls.settings_of(section))

    @classmethod
    def _with_parts(cls, section: Mapping[str, Any]) -> dict[str, Any]:
        return dict(section)  # the flat keys are the parts' description: the constructor translates them

    @classmethod
    def _part_files(cls, section: Mapping[str, Any]) -> dict[str, str]:
        return {}  # the tower's one file is `vit_pretrained` (FILE_KEYS)

    @classmethod
    def published_settings(cls, section: dict[str, Any]) -> dict[str, Any]:
        """None: a BLIP-2 checkpoint in ``pretrained`` brings weights of the image path only."""
        return section

    @classmethod
    def config_problems(cls, section: Mapping[str, Any]) -> list[str]:
        """Keys under ``vit`` that have their own top-level key, and what the parts' sections refuse, each named by
        its flat key."""
        problems = [f"model.vit.{k}: set it with model.{VIT_KEYS_SET_AT_TOP_LEVEL[k]}, not under vit"
                    for k in sorted(section.get("vit") or {}) if k in VIT_KEYS_SET_AT_TOP_LEVEL]
        problems += [f"model.{k}: blip2_qwen sets its parts with its own keys ({', '.join(FLAT_KEYS)}); for other "
                     "parts use an architecture that takes part sections (arch: llava)"
                     for k in ("vision_tower", "connector") if k in section]
        unknown = [key for key, target in cls.NESTED_SCHEMAS.items()
                   if any(k not in fields_of(target) for k in section.get(key) or {})]
        wrong_types: list[str] = []
        fields = fields_of(cls)
        check_section({k: v for k, v in section.items() if k in FLAT_KEYS}, {k: fields[k] for k in FLAT_KEYS}, "model",
                      wrong_types, require=False)
        if problems or unknown or wrong_types:  # the parts are not built from what the validator reports
            return problems + [flat_name(p) for p in VisionLLM.config_problems.__func__(cls, section)]
        return [flat_name(p) for p in super().config_problems(section)]

    @classmethod
    def part_schema_problems(cls, section: Mapping[str, Any]) -> list[str]:
        return []  # the parts' keys are the flat keys, which the model section's own schema checks

    def load_from_pretrained(self, path: str) -> None:
        """Load a BLIP-2 checkpoint (``pretrained``): a LAVIS ``.pth`` or a Hugging Face BLIP-2 folder.

        Sets ``ln_vision``, the Q-Former, its queries and, if the file has them, the ViT.
        See ``lavis_ds.models.pretrained`` for the key mapping and the keys skipped on purpose.
        """
        load_blip2(self, path, vit_loaded=self.vit_pretrained is not None)


def check_vit_overrides(vit: Mapping[str, Any] | None) -> None:
    """Raise where ``vit`` repeats a setting that has its own top-level key."""
    clashes = sorted(k for k in (vit or {}) if k in VIT_KEYS_SET_AT_TOP_LEVEL)
    if clashes:
        raise ValueError("set these with their top-level model keys, not under `vit:`: " +
                         ", ".join(f"vit.{k} -> {VIT_KEYS_SET_AT_TOP_LEVEL[k]}" for k in clashes))


def flat_name(problem: str) -> str:
    """A part section's problem (``model.vision_tower.image_size: ...``) under the flat key a user wrote."""
    for key, (part, part_key) in FLAT_KEYS.items():
        prefix = f"model.{part}.{part_key}"
        if problem.startswith(prefix) and problem[len(prefix):len(prefix) + 1] in (":", ".", " "):
            return f"model.{key}{problem[len(prefix):]}"
    return problem


# MiniGPT4Qwen's name for the same architecture (Coobiw/MPP-LLaVA: `arch: minigpt4qwen`).
reg.models.register_alias("minigpt4qwen", "blip2_qwen")
