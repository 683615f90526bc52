"""Qwen3.5 as a transformers class (the ``qwen3_5`` family): its published folders load into the ``qwen3_5``
architecture, part for part, and ``--format hf`` writes one back.

    model.visual.* (without merger)           <- vision_tower (``towers.qwen3_vl``, no DeepStack taps)
    model.visual.merger.*                     <- connector.merger (``qwen3_vl_merger``, no DeepStack mergers)
    model.language_model.*                    <- llm_model.model (``qwen3_5_text``: Qwen3.5's hybrid text model)
    lm_head.*                                 <- llm_model.lm_head

Everything else is Qwen3-VL's family (``hf.qwen3_vl``): the folder's vision config, pixel bounds, text config,
tokenizer and chat template's vision tokens, ``Qwen3VLProcessor`` (transformers' processor for both). What differs:
the folder's vision config has no ``deepstack_visual_indexes`` (the tower gets none, the connector no DeepStack
merger), and the class is read and written by the ``qwen3_5`` architecture only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.hf.qwen3_vl import Qwen3VLFamily, Qwen3VLFolders, Qwen3VLProcessors, Qwen3VLWeights
from lavis_ds.models.template_defaults import settable


class Qwen35Weights(Qwen3VLWeights):
    def hf_vision_config(self, model: nn.Module) -> dict[str, Any]:
        """The tower's config cut to ``Qwen3_5VisionConfig``'s keys: no DeepStack, and its own rotary settings (the
        axial 2-D rotary of theta 10,000 that the qwen3_vl tower computes; it refuses Qwen3-VL's "default" type)."""
        from transformers import Qwen3_5VisionConfig

        keys = set(Qwen3_5VisionConfig.__annotations__) - {"model_type", "rope_parameters"}
        return {k: v for k, v in model.vision_tower.config.to_dict().items() if k in keys}


class Qwen35Processors(Qwen3VLProcessors):
    def export_chat_template(self, model: nn.Module) -> str | None:
        """The published chat template the model's prompt is rendered by (lavis_ds's ChatML template writes no think
        block), with the model's template variables (``enable_thinking: false``) and system prompt as its defaults:
        the one call without arguments prompts as lavis_ds does, and a caller may still pass its own."""
        from lavis_ds.models.chat_template import template_text

        published = template_text(model.llm.tokenizer)
        if published is None:
            return None
        return template_defaults(model.llm.prompt.template_variables, model.llm.prompt.system_prompt) + published


class Qwen35Folders(Qwen3VLFolders):
    def connector_settings(self, config: Any) -> dict[str, Any]:
        """No DeepStack merger."""
        return {"deepstack_taps": 0}

    def merger_problems(self, model: nn.Module, config: Any) -> list[str]:
        taps = model.connector.deepstack_taps
        return [] if taps == 0 else [f"qwen3_vl_merger deepstack_taps: folder 0, model {taps}"]

    def published_settings(self, section: dict[str, Any], folder: Path, config: Any) -> dict[str, Any]:
        """As Qwen3-VL's, the tower tapping no block where the section says nothing of DeepStack."""
        section = super().published_settings(section, folder, config)
        section["vision_tower"]["vision_config"].setdefault("deepstack_visual_indexes", [])
        return section


class Qwen35Family(Qwen3VLFamily):
    hf_class, model_type, tower, arch = "Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_vl", "qwen3_5"
    exportable = "a qwen3_vl tower without DeepStack + qwen3_vl_merger + the qwen3_5_text model"

    def __init__(self):
        super().__init__(Qwen35Weights, Qwen35Processors, Qwen35Folders)


def template_defaults(variables: dict[str, Any], system_prompt: str | None) -> str:
    """Jinja that sets each of ``variables`` where the caller gives none and puts ``system_prompt`` in front of the
    messages where they start without a system message (values as Jinja literals, ``template_defaults.jinja_literal``)."""
    head = settable(variables).prelude()
    if system_prompt is not None:
        system = json.dumps({"role": "system", "content": system_prompt}, ensure_ascii=False)
        head += ("{%- if not messages or messages[0]['role'] != 'system' -%}"
                 f"{{%- set messages = [{system}] + messages -%}}{{%- endif -%}}")
    return head


reg.hf_families.register("qwen3_5")(Qwen35Family())
