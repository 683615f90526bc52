"""What differs between LLM families, found from the model itself: its class, its decoder layers, its LoRA targets;
and how each numbers its tokens (``position_provider``: the table ``FAMILY_POSITIONS``).

The LLM slot takes any causal LM transformers knows (Qwen2/2.5, Qwen3, Llama 3.x,
Gemma, Mistral, ...): ``model.llm_model`` (a folder) goes through ``AutoModelForCausalLM``,
``model.llm_config`` (an architecture for a random initialisation) through ``AutoConfig``
with its ``model_type`` (default ``qwen2``, so the Qwen2.5 YAMLs keep their meaning).
Nothing here lists families: names come from the model's own modules.
"""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lavis_ds.common.registry import position_providers
from lavis_ds.common.suggest import did_you_mean
from lavis_ds.models.linear_attention import LANGUAGE_MODEL_OF
from lavis_ds.models.positions import PositionProvider
from lavis_ds.models.qwen_vl_text import TEXT_CAUSAL_LMS

DEFAULT_MODEL_TYPE = "qwen2"  # what llm_config meant before it took a model_type
# The position provider (lavis_ds.models.positions) of each family that does not take plain 1-D positions, by its
# text model's transformers model_type: Qwen2-VL's and Qwen2.5-VL's text models take M-RoPE's three rows (and the
# plain positions as a fourth row in front, for packed sample boundaries). Every other family: rope_1d.
FAMILY_POSITIONS = {"qwen2_vl_text": "mrope", "qwen2_5_vl_text": "mrope",
                    # Qwen3-VL numbers an image's tokens as Qwen2-VL does; its text model interleaves the rows'
                    # frequencies (mrope_interleaved) itself
                    "qwen3_vl_text": "mrope",
                    # Qwen3.5's text model takes the same rows (interleaved over its rotary quarter of each head);
                    # without a grid (a Q-Former's queries, text) the rows are equal, as its plain positions
                    "qwen3_5_text": "mrope"}


def llm_config_problems(llm_config: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with ``model.llm_config``'s ``model_type``, found before anything is built (empty: nothing)."""
    model_type = (llm_config or {}).get("model_type", DEFAULT_MODEL_TYPE)
    if model_type in LANGUAGE_MODEL_OF:
        return [f"model.llm_config.model_type: {model_type!r} is a vision-language model; the LLM slot takes its "
                f"language model: model_type: {LANGUAGE_MODEL_OF[model_type]}"]
    if model_type in TEXT_CAUSAL_LMS:
        return _mrope_section_problems(llm_config or {}) if FAMILY_POSITIONS.get(model_type) == "mrope" else []
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return []
    if model_type in CONFIG_MAPPING:
        return [f"model.llm_config.model_type: {model_type!r} is not a causal language model in transformers "
                f"(AutoModelForCausalLM has no class for it)"]
    hint = did_you_mean(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, n=3)
    hint = f" ({hint})" if hint else ""
    return [f"model.llm_config.model_type: unknown model_type {model_type!r}{hint}; it names a transformers "
            "architecture such as qwen2, qwen3, llama, gemma2 or mistral"]


def transformers_config(llm_config: Mapping[str, Any], **defaults: Any) -> PretrainedConfig:
    """The transformers config of ``model.llm_config`` (``model_type`` picks the architecture; ``defaults`` fill
    keys it does not set, e.g. ``vocab_size``)."""
    problems = llm_config_problems(llm_config)
    if problems:
        raise ValueError(problems[0])
    kwargs = {**defaults, **llm_config}
    return AutoConfig.for_model(kwargs.pop("model_type", DEFAULT_MODEL_TYPE), **kwargs)


def llm_text_config(llm_model: str | None, llm_config: Mapping[str, Any] | None) -> PretrainedConfig:
    """The text config of the LLM a ``model:`` section names, without building it: its folder's config.json (a
    vision-language folder's text config), else ``llm_config`` with transformers' defaults."""
    config = AutoConfig.from_pretrained(llm_model) if llm_model is not None else transformers_config(llm_config or {})
    return config.get_text_config(decoder=True)


def _mrope_section_problems(section: Mapping[str, Any]) -> list[str]:
    """M-RoPE splits each head's rotary frequencies (half its rotary dimensions: the head, or Qwen3.5's
    ``partial_rotary_factor`` of it) into temporal, height and width parts: ``mrope_section`` must add up to them
    (transformers' default [16, 24, 24] fits a fully rotary head of 128 only). Qwen3.5's text model, given no section,
    takes [11, 11, 10] and spreads it over what rotary frequencies there are (the published models have 32)."""
    config = AutoConfig.for_model(**{k: v for k, v in section.items()})
    rope = config.rope_parameters or {}
    if "mrope_section" not in rope and config.model_type == "qwen3_5_text":
        return []
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    parts = rope.get("mrope_section", [16, 24, 24])
    if sum(parts) == rotary // 2:
        return []
    return [f"model.llm_config.rope_parameters.mrope_section: {list(parts)} adds up to {sum(parts)}, but M-RoPE "
            f"splits half the rotary dimensions of each head ({rotary} // 2 = {rotary // 2}) into its temporal, height "
            "and width parts; give three numbers that add up to it"]


def causal_lm_class(config: PretrainedConfig) -> type:
    """The class that builds ``config``'s causal LM: ``AutoModelForCausalLM``'s, or lavis_ds's own text models
    (``lavis_ds.models.qwen_vl_text``; a Qwen3.5 vision-language config builds its language model's)."""
    model_type = getattr(config, "model_type", None)
    own = TEXT_CAUSAL_LMS.get(LANGUAGE_MODEL_OF.get(model_type, model_type))
    return own if own is not None else MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def decoder_layers(llm: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a transformers causal LM, in order: the units FSDP shards one at a time and
    gradient checkpointing recomputes.

    The decoder's ``layers`` ModuleList where it has one (Qwen, Llama, Gemma, Mistral, Phi-3), else the
    modules whose class the model names as never to be split across devices (``_no_split_modules``).
    """
    decoder = llm.get_decoder() if hasattr(llm, "get_decoder") else llm
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return list(layers)
    unsplit = set(getattr(llm, "_no_split_modules", None) or ())
    blocks = [module for module in decoder.modules() if type(module).__name__ in unsplit]
    if not blocks:
        raise ValueError(f"cannot find the decoder layers of {type(llm).__name__}: its decoder has no `layers` "
                         f"ModuleList and no module of a class in _no_split_modules ({sorted(unsplit)})")
    return blocks


def position_provider(config: PretrainedConfig) -> PositionProvider:
    """How the LLM of ``config`` numbers its tokens (``FAMILY_POSITIONS``; 1-D unless the table says otherwise)."""
    return position_providers.get(FAMILY_POSITIONS.get(getattr(config, "model_type", None), "rope_1d"))()
