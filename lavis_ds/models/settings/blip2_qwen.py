"""The config side of BLIP2-Qwen (``models.blip2_qwen``): MiniGPT4Qwen's flat keys (``vit_model``, ``image_size``,
``vit_precision``, ``freeze_vit``, ``num_query_token``, ``qformer``, ...) read as the ``eva_vit_g`` tower's and the
``qformer`` connector's sections (:func:`part_sections_of`, the one place they are translated, for the config check
and the constructor alike), each part's problem reported under the flat key a user wrote; :func:`refused_keys` is
what both refuse of the keys themselves."""
from __future__ import annotations

from typing import Any, Mapping

from transformers import Blip2QFormerConfig

from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.models.eva_vit import EvaViT
from lavis_ds.models.settings.composed import PART_KINDS, ComposedSettings
from lavis_ds.models.settings.vision_llm import VisionLLMSettings

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
# MiniGPT4Qwen's (Coobiw/MPP-LLaVA) model_types: Qwen-1 chat models, tiktoken tokenizer and remote code.
_QWEN1 = "it is MiniGPT4Qwen's Qwen-1 chat model (tiktoken tokenizer, remote code), which lavis_ds does not load"


class Blip2QwenSettings(ComposedSettings):
    """A blip2_qwen ``model:`` section: the flat keys describe the parts, the rest is the LLM's."""

    # Nested dict keys and the class whose arguments they are: the config validator checks them too
    # (`llm_config` is not listed: transformers configs take extra keys on purpose).
    NESTED_SCHEMAS = {"qformer": Blip2QFormerConfig, "vit": EvaViT}
    REPLACED_MODEL_TYPES = {
        "qwen7b_chat": ("qwen2.5_7b_instruct", _QWEN1),
        "qwen14b_chat": ("qwen2.5_7b_instruct", _QWEN1),
        "qwen1.8b_chat": ("qwen2.5_1.5b_instruct", _QWEN1),
    }
    # loaded whatever load_pretrained says, as LAVIS does
    FILE_KEYS = (*ComposedSettings.FILE_KEYS, "vit_pretrained")
    # The datasets keep their builders' processors (blip2_image_*), as LAVIS's BLIP-2 configs name them.
    IMAGE_PROCESSORS: dict[str, str] = {}

    def part_sections(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The parts' sections the flat keys give, each key's default where the section leaves it out."""
        return part_sections_of(self.arguments())

    def _with_parts(self) -> dict[str, Any]:
        return dict(self.section)  # the flat keys are the parts' description: the constructor translates them

    def _part_files(self) -> dict[str, str]:
        return {}  # the tower's one file is `vit_pretrained` (FILE_KEYS)

    def with_published(self) -> dict[str, Any]:
        """As given: a BLIP-2 checkpoint in ``pretrained`` brings weights of the image path only."""
        return dict(self.section)

    def problems(self) -> list[str]:
        """The refused keys (``refused_keys``), and what the parts' sections refuse, each named by its flat key."""
        section, problems = self.section, refused_keys(self.section)
        unknown = [key for key, target in self.NESTED_SCHEMAS.items()
                   if any(k not in fields_of(target) for k in section.get(key) or {})]
        wrong_types: list[str] = []
        fields = fields_of(self.arch)
        check_section({k: v for k, v in section.items() if k in FLAT_KEYS}, {k: fields[k] for k in FLAT_KEYS}, "model",
                      wrong_types, require=False)
        if problems or unknown or wrong_types:  # the parts are not built from what the validator reports
            return problems + [flat_name(p) for p in VisionLLMSettings.problems(self)]
        return [flat_name(p) for p in super().problems()]

    def part_problems(self) -> list[str]:
        return []  # the parts' keys are the flat keys, which the model section's own schema checks


def refused_keys(section: Mapping[str, Any]) -> list[str]:
    """What the constructor refuses (and the config check reports) of the keys themselves: a ``vit:`` key that has
    its own top-level key, a part section (blip2_qwen's parts are its flat keys)."""
    problems = [f"model.vit.{k}: set it with model.{VIT_KEYS_SET_AT_TOP_LEVEL[k]}, not under vit "
                f"(vit.{k} -> {VIT_KEYS_SET_AT_TOP_LEVEL[k]})"
                for k in sorted(section.get("vit") or {}) if k in VIT_KEYS_SET_AT_TOP_LEVEL]
    return problems + [f"model.{k}: blip2_qwen sets its parts with its own keys ({', '.join(FLAT_KEYS)}); for "
                       "other parts use an architecture that takes part sections (arch: llava)"
                       for k in PART_KINDS if k in section]


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


def flat_name(problem: str) -> str:
    """A part section's problem (``model.vision_tower.image_size: ...``) under the flat key a user wrote."""
    for key, (part, part_key) in FLAT_KEYS.items():
        prefix = f"model.{part}.{part_key}"
        if problem.startswith(prefix) and problem[len(prefix):len(prefix) + 1] in (":", ".", " "):
            return f"model.{key}{problem[len(prefix):]}"
    return problem
