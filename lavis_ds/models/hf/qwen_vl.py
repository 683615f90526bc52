"""Qwen2-VL and Qwen2.5-VL as transformers classes (the ``qwen2_vl`` and ``qwen2_5_vl`` families): their published
folders load into the ``qwen2_vl`` / ``qwen2_5_vl`` architectures, part for part.

    visual.* (without merger)            <- vision_tower (``towers.qwen_vl``: transformers' names)
    visual.merger.*                      <- connector (``patch_merger``: ``ln_q``, ``mlp.0``, ``mlp.2``)
    model.* (embed_tokens, layers, norm) <- llm_model.model (``qwen_vl_text``: the text model alone)
    lm_head.*                            <- llm_model.lm_head

A folder may hold them as the Hub's files do (``visual.*``, ``model.layers.*``) or as transformers 5 names the
modules (``model.visual.*``, ``model.language_model.*``); both are read. A folder brings its vision config (the
tower's architecture), its processor's ``min_pixels`` / ``max_pixels``, its text config (with the top level's
``tie_word_embeddings``), its tokenizer and image token; its chat template must write the family's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``), which lavis_ds's prompt writes around each image.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.hf.family import HfFamily, State, differences, part_name
from lavis_ds.models.parts import PartError

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# The text model's keys in the two layouts: the Hub's (model.layers.*) and transformers 5's (model.language_model.*).
TEXT_PREFIXES = ("model.language_model.", "model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")


class QwenVLFamily(HfFamily):
    """A ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` folder; the subclasses below
    are data only."""

    tower: str = ""  # the registry name of the tower (and the architecture) its folders need
    norm: str = ""  # the patch_merger's norm
    reads_published = True
    tower_prefixes = ("visual.", "model.visual.")
    llm_prefixes = TEXT_PREFIXES


    # ----------------------------------------------------------------- export
    def export_problems(self, model: nn.Module) -> list[str]:
        """lavis_ds reads these folders but does not write them: one line saying so and what to use."""
        return [f"the {self.model_type} architecture: lavis_ds loads {self.hf_class} folders (model.pretrained) but "
                f"does not write them; export it with --format lavis_ds (the default), which lavis_ds's generate, "
                "chat and web page load"]

    # ----------------------------------------------------------------- published folders
    def published_settings(self, section: dict[str, Any], folder: Path, config: Any) -> dict[str, Any]:
        """The tower's architecture and pixel bounds, the text model's tied head; the architecture's tower and the
        chat template's vision tokens checked."""
        tower = dict(section.get("vision_tower") or {})
        if tower.get("name") != self.tower:
            raise PartError(f"model.pretrained: {folder} is a {self.hf_class} folder (config.json model_type "
                            f"{self.model_type!r}), but the model's vision tower is {tower.get('name')!r}; load it "
                            f"with model.arch: {self.tower} (its tower {self.tower}, patch_merger norm {self.norm})")
        own = vision_keys(config.vision_config, reg.vision_towers.get(self.tower).config_keys())
        tower["vision_config"] = {**own, **(tower.get("vision_config") or {})}
        # The folder's processor bounds where the section sets none (a smaller max_pixels saves memory: the user's).
        tower.update({k: v for k, v in pixel_bounds(folder).items() if tower.get(k) is None})
        connector = {**(section.get("connector") or {}), "norm": self.norm}
        section = {**section, "vision_tower": tower, "connector": connector}
        if isinstance(section.get("llm_config"), dict):
            section["llm_config"] = {**section["llm_config"],
                                     "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))}
        check_template(section.get("tokenizer") or section.get("llm_model"), folder)
        return section

    def fit_problems(self, model: nn.Module, config: Any) -> list[str]:
        """The tower kind and architecture, the merger's norm and widths."""
        tower = model.vision_tower
        name = part_name(tower, reg.vision_towers)
        if name != self.tower:
            return [f"vision tower: the folder's is {self.tower}, the model's {name}"]
        differ = self.connector_problems(model)
        ours = tower.config.to_dict()
        keys = tuple(k for k in vision_keys(config.vision_config, type(tower).config_keys()) if k in ours)
        differ += differences("vision tower", config.vision_config, ours, keys)
        norm = type(model.connector.ln_q).__name__.lower()
        if norm != self.norm:
            differ.append(f"patch_merger norm: folder {self.norm}, model {norm}")
        return differ

    def tower_config(self, folder: Path) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder).vision_config

    def llm_state(self, state: State) -> dict[str, torch.Tensor]:
        """The text model's keys as ``qwen_vl_text``'s causal LM names them (``model.*``, ``lm_head.*``)."""
        return {("model." + key.removeprefix("model.language_model.") if key.startswith("model.language_model.")
                 else key): value for key, value in state.items()}


def vision_keys(vision_config: Any, valid: list[str]) -> dict[str, Any]:
    """The vision config's own keys that the tower takes (``depth``, ``hidden_size``, ...)."""
    values = vision_config.to_dict() if hasattr(vision_config, "to_dict") else dict(vision_config)
    return {k: v for k, v in values.items() if k in valid and k not in ("model_type", "dtype")}


def pixel_bounds(folder: Path) -> dict[str, int]:
    """``min_pixels`` / ``max_pixels`` of the folder's image processor, where it has one: preprocessor_config.json
    (the Hub's folders) or the ``image_processor`` of processor_config.json (transformers 5's save_pretrained)."""
    saved: dict[str, Any] = {}
    if (folder / "preprocessor_config.json").is_file():
        saved = json.loads((folder / "preprocessor_config.json").read_text())
    elif (folder / "processor_config.json").is_file():
        saved = json.loads((folder / "processor_config.json").read_text()).get("image_processor") or {}
    size = saved.get("size") or {}
    bounds = {"min_pixels": saved.get("min_pixels", size.get("shortest_edge")),
              "max_pixels": saved.get("max_pixels", size.get("longest_edge"))}
    return {k: int(v) for k, v in bounds.items() if v is not None}


def check_template(tokenizer_folder: str | None, folder: Path) -> None:
    """A chat template (of the tokenizer the model uses) that does not write the vision tokens is refused: it is
    not a Qwen-VL template, and its prompts would not be the ones the published model was trained on."""
    from transformers import AutoTokenizer

    from lavis_ds.models.chat_template import template_text

    source = Path(tokenizer_folder).expanduser() if tokenizer_folder else folder
    if not (source / "tokenizer_config.json").is_file():
        return  # reported by the file check (or the folder has no tokenizer: model.tokenizer names one)
    template = template_text(AutoTokenizer.from_pretrained(source))
    missing = [token for token in VISION_TOKENS if template is not None and token not in template]
    if missing:
        raise PartError(f"model.tokenizer: the chat template of {source} does not write {', '.join(missing)}; a "
                        "Qwen-VL model takes each image as <|vision_start|><|image_pad|>...<|vision_end|>, as the "
                        "published chat template writes it; use the published folder's tokenizer (with its "
                        "chat_template) or a template that writes these tokens")


class Qwen2VLFamily(QwenVLFamily):
    hf_class, model_type, tower, norm = "Qwen2VLForConditionalGeneration", "qwen2_vl", "qwen2_vl", "layernorm"
    pairs = (("qwen2_vl", "patch_merger"),)
    exportable = "a qwen2_vl tower + patch_merger (norm layernorm) + the qwen2_vl_text model"


class Qwen25VLFamily(QwenVLFamily):
    hf_class, model_type, tower, norm = "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "qwen2_5_vl", "rmsnorm"
    pairs = (("qwen2_5_vl", "patch_merger"),)
    exportable = "a qwen2_5_vl tower + patch_merger (norm rmsnorm) + the qwen2_5_vl_text model"


reg.hf_families.register("qwen2_vl")(Qwen2VLFamily())
reg.hf_families.register("qwen2_5_vl")(Qwen25VLFamily())
