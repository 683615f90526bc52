"""Published checkpoints split into parts: pure functions from a file's state dict to each part's own keys.

Each function takes ``{file key: tensor}`` and returns the keys of one part as that part's ``state_dict``
names them (tower, connector, or the causal LM); keys that belong to other parts are left out. Sources:

- transformers ``LlavaForConditionalGeneration``, in the layouts its ``save_pretrained`` writes:
  ``vision_tower`` / ``multi_modal_projector`` / ``language_model.model`` + ``language_model.lm_head``
  (transformers 5.24 writes this, the tower without its ``vision_model.`` level; transformers before 4.52
  wrote it with that level), and ``model.vision_tower`` / ``model.multi_modal_projector`` /
  ``model.language_model`` + ``lm_head`` (transformers 4.52 to 4.x; the tests build it by renaming).
- transformers ``InstructBlipForConditionalGeneration`` / ``Blip2ForConditionalGeneration``:
  ``vision_model`` (EVA layout; its ``post_layernorm`` is BLIP-2's ``ln_vision``), ``qformer``,
  ``query_tokens``, ``language_projection``, ``language_model``.
- LAVIS ``blip2_vicuna_instruct`` / BLIP-2 ``.pth`` (``{'model': ...}``): ``visual_encoder``, ``ln_vision``,
  ``Qformer.bert`` (``attention.self``), ``query_tokens``, ``llm_proj``.
- LLaVA's stage-1 ``mm_projector.bin``: ``model.mm_projector.0/2.*``.
"""
from __future__ import annotations

import re
from typing import Mapping

import torch
from torch import nn

from lavis_ds.models.pretrained import (HF_RENAMES, LAVIS_QFORMER_RENAMES, fit_pos_embed, rename_key,
                                        _split_qkv_bias)

State = Mapping[str, torch.Tensor]

# Which LLaVA layout a file has, by the prefix its parts sit under.
LLAVA_TOWER = (r"model\.vision_tower\.", r"vision_tower\.")
LLAVA_PROJECTOR = (r"model\.multi_modal_projector\.", r"multi_modal_projector\.")
LLAVA_LLM = ((r"model\.language_model\.", "model."), (r"language_model\.model\.", "model."),
             (r"language_model\.lm_head\.", "lm_head."), (r"lm_head\.", "lm_head."))

# LAVIS Q-Former -> transformers' InstructBlipQFormerModel: its embeddings keep the instruction's word and
# position embeddings, and its LayerNorm sits under `embeddings` (Blip2QFormerModel's is at the root).
LAVIS_INSTRUCT_QFORMER_RENAMES = (
    (r"Qformer\.bert\.embeddings\.LayerNorm\.", "qformer.embeddings.layernorm."),
    *LAVIS_QFORMER_RENAMES[1:],
)
# Buffers and heads a Q-Former file may hold that no connector has.
QFORMER_UNUSED = re.compile(r"(Qformer\.cls\.|Qformer\.bert\.embeddings\.position_ids$|"
                            r"qformer\.embeddings\.position_ids$)")


def _take(state: State, prefixes: tuple[str, ...], replacement: str = "") -> dict[str, torch.Tensor]:
    """The keys under the first of ``prefixes`` the file uses, with that prefix replaced."""
    for prefix in prefixes:
        taken = {re.sub("^" + prefix, replacement, k): v for k, v in state.items() if re.match(prefix, k)}
        if taken:
            return taken
    return {}


# ----------------------------------------------------------------- LLaVA
def llava_tower(state: State) -> dict[str, torch.Tensor]:
    """A LLaVA file's vision tower, keyed as a transformers vision model without its ``vision_model.`` level."""
    return {re.sub(r"^vision_model\.", "", k): v for k, v in _take(state, LLAVA_TOWER).items()}


def llava_projector(state: State) -> dict[str, torch.Tensor]:
    """A LLaVA file's projector: ``linear_1.*``, ``linear_2.*`` (the ``mlp2x_gelu`` connector's names)."""
    return _take(state, LLAVA_PROJECTOR)


def llava_llm(state: State) -> dict[str, torch.Tensor]:
    """A LLaVA file's language model, keyed as its ``AutoModelForCausalLM`` (``model.*``, ``lm_head.*``)."""
    out = {}
    for key, value in state.items():
        for pattern, replacement in LLAVA_LLM:
            if re.match(pattern, key):
                out[re.sub("^" + pattern, replacement, key)] = value
                break
    return out


def mm_projector(state: State) -> dict[str, torch.Tensor]:
    """LLaVA's stage-1 ``mm_projector.bin`` keyed as our connectors: ``model.mm_projector.{0,2}.*`` (an
    ``nn.Sequential`` of Linear, GELU, Linear) as ``mlp2x_gelu``'s ``linear_1.*``, ``linear_2.*``, and
    LLaVA-1.0's single ``model.mm_projector.*`` Linear as ``linear``'s ``proj.*``."""
    names = {"0": "linear_1", "2": "linear_2", None: "proj"}
    out = {}
    for key, value in state.items():
        match = re.match(r"(?:model\.)?mm_projector\.(?:(\d+)\.)?(weight|bias)$", key)
        if match and match.group(1) in names:
            out[f"{names[match.group(1)]}.{match.group(2)}"] = value
    return out


def hf_vision_keys(state: State, model: nn.Module) -> dict[str, torch.Tensor]:
    """``llava_tower`` keys renamed to what ``model`` (a transformers vision model) holds: with or without the
    ``vision_model.`` level, which differs between transformers versions."""
    nested = any(k.startswith("vision_model.") for k in model.state_dict())
    return {("vision_model." + k if nested else k): v for k, v in state.items()}


# ----------------------------------------------------------------- BLIP-2 / InstructBLIP
def eva_from_hf(state: State, vit: nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face BLIP-2 / InstructBLIP ``vision_model`` as ``EvaViT`` keys (its ``post_layernorm`` is the
    connector's ``ln_vision``, left out); q/v biases split out of the fused ``qkv.bias``, position embedding
    interpolated to ``vit``'s grid."""
    vision = {rename_key(k, HF_RENAMES): v for k, v in state.items()
              if k.startswith("vision_model.") and not k.startswith("vision_model.post_layernorm.")}
    vision = _split_qkv_bias({k.removeprefix("visual_encoder."): v for k, v in vision.items()})
    return fit_pos_embed(vision, "pos_embed", vit)


def eva_from_lavis(state: State, vit: nn.Module) -> dict[str, torch.Tensor]:
    """A LAVIS BLIP-2 / InstructBLIP ``.pth``'s ``visual_encoder.*`` as ``EvaViT`` keys (empty if the file has
    none: LAVIS saves only trained parameters, and the ViT is frozen)."""
    vision = {k.removeprefix("visual_encoder."): v for k, v in state.items() if k.startswith("visual_encoder.")}
    return fit_pos_embed(vision, "pos_embed", vit) if vision else vision


def qformer_from_hf(state: State) -> dict[str, torch.Tensor]:
    """A Hugging Face BLIP-2 / InstructBLIP folder's bridge keyed as the ``qformer`` / ``instruct_qformer``
    connectors: ``ln_vision``, ``qformer``, ``query_tokens``, ``llm_proj``."""
    out = {}
    for key, value in state.items():
        if key.startswith("vision_model.post_layernorm."):
            out[key.replace("vision_model.post_layernorm.", "ln_vision.")] = value
        elif key.startswith("language_projection."):
            out[key.replace("language_projection.", "llm_proj.")] = value
        elif (key.startswith("qformer.") or key == "query_tokens") and not QFORMER_UNUSED.match(key):
            out[key] = value
    return out


def qformer_from_lavis(state: State, instruct: bool) -> dict[str, torch.Tensor]:
    """A LAVIS ``.pth``'s bridge (``Qformer.bert.*``, ``query_tokens``, ``ln_vision``, ``llm_proj``) keyed as the
    connectors. ``instruct``: the InstructBLIP Q-Former (``blip2_vicuna_instruct``), whose text embeddings
    and text feed-forward layers are used; BLIP-2's Q-Former leaves those out (see ``pretrained.SKIPPED_KEYS``)."""
    renames = LAVIS_INSTRUCT_QFORMER_RENAMES if instruct else LAVIS_QFORMER_RENAMES
    text_only = re.compile(r"Qformer\.bert\.(embeddings\.(word_embeddings|position_embeddings)\.|"
                           r"encoder\.layer\.\d+\.(intermediate|output)\.)")
    out = {}
    for key, value in state.items():
        if QFORMER_UNUSED.match(key) or (not instruct and text_only.match(key)):
            continue
        if key.startswith(("Qformer.bert.", "ln_vision.", "llm_proj.")) or key == "query_tokens":
            out[rename_key(key, renames)] = value
    return out
