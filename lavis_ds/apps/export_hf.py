"""Export a checkpoint as a Hugging Face BLIP-2 folder that transformers alone loads and runs.

``python export.py RUN --out DIR --format hf`` writes what
``Blip2ForConditionalGeneration.from_pretrained(DIR)`` and ``AutoProcessor.from_pretrained(DIR)``
read, with no lavis_ds import (docs/export-hf.md shows the lines a transformers user writes):

    config.json, generation_config.json, model.safetensors   the model (Blip2Config: vision_config,
        qformer_config, text_config = the LLM's own config, num_query_tokens, image_token_index)
    tokenizer files, chat_template.jinja                      the tokenizer as the model used it;
        the chat template writes lavis_ds's ChatML prompt, image placeholders included
    preprocessor_config.json, processor_config.json           BLIP's image processor set to the
        export's eval image processor (square bicubic resize + normalisation)
    lavis_ds_export.json                                      where it came from; ignored by transformers

The key mapping (ours -> Hugging Face) is the inverse of the one ``lavis_ds.models.pretrained`` reads
Hugging Face BLIP-2 folders with: the timm EVA ViT becomes ``vision_model`` (its q/v biases one
``qkv.bias`` with a zero k part), ``ln_vision`` its ``post_layernorm``; ``qformer`` and ``query_tokens``
keep their names (lavis_ds uses transformers' Q-Former); ``llm_proj`` becomes ``language_projection``
and the LLM, with LoRA and trained token rows merged, ``language_model``.

What ``Blip2ForConditionalGeneration`` cannot compute the same way is refused before anything is
written, every problem in one :class:`~lavis_ds.apps.export.ExportError` (exit 2 from the command line).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.apps.export import (DTYPES, ExportError, find_checkpoint, load_trained_weights, read_checkpoint,
                             run_tokenizer, write_whole)
from lavis_ds.apps.export_hf_checks import EVAL_IMAGE_PROCESSOR, activation_name, check_expressible
from lavis_ds.apps.export_hf_processor import generation_config, save_processor
from lavis_ds.models.llm_placement import empty_weights
from lavis_ds.models.pretrained import _rename_key  # one renamer for both directions

MARKER_FILE = "lavis_ds_export.json"
# Ours -> Hugging Face, the inverse of pretrained.HF_RENAMES (a test checks that they agree). The q/v
# biases are not renamed but fused into qkv.bias, see `vision_state_dict`.
VISION_RENAMES = (
    (r"cls_token$", "embeddings.class_embedding"),
    (r"pos_embed$", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"blocks\.(\d+)\.norm([12])\.", r"encoder.layers.\1.layer_norm\2."),
    (r"blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
)


# ----------------------------------------------------------------------------- the command's entry point
def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the Hugging Face BLIP-2 folder (see the module docstring) of the checkpoint ``source`` names.

    Args:
        source: A checkpoint folder, or a run's output_dir (its newest complete checkpoint).
        out_dir: Folder to create; an existing non-empty one is replaced only if it is an earlier
            ``--format hf`` export and ``overwrite`` is true.

    Returns:
        ``out_dir``, written beside itself and renamed: it appears whole or not at all.
    """
    tag_dir = find_checkpoint(source)
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    weights, info = read_checkpoint(tag_dir)
    cfg = info["config"]
    model = trained_model(cfg, weights, tag_dir)
    image_cfg = eval_image_processor(cfg)
    check_expressible(model, image_cfg)

    def write(tmp: Path) -> None:
        notes = write_hf_folder(model, tmp, image_cfg, info["dtype"])
        provenance = {"source": str(tag_dir.resolve()), "global_step": info["global_step"], "epoch": info["epoch"],
                      "runner": info["runner"], "zero_stage": info["zero_stage"], "dtype": info["dtype"],
                      "notes": notes}
        (tmp / MARKER_FILE).write_text(json.dumps(provenance, indent=2) + "\n")

    write_whole(out, write)  # replaces `out` only if _check_out_dir allowed it
    return out


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not (out / MARKER_FILE).is_file():
        raise ExportError(f"{out} exists and is not a --format hf export folder (no {MARKER_FILE}): "
                          "choose a new --out folder")
    if not overwrite:
        raise ExportError(f"{out} already holds an export: choose a new --out folder or pass --overwrite")


def trained_model(cfg: DictConfig, weights: dict[str, torch.Tensor], tag_dir: Path) -> nn.Module:
    """The run's model rebuilt from its config, with the checkpoint's trained weights, LoRA merged, in eval mode."""
    from lavis_ds.build import build_model

    run_tokenizer(OmegaConf.to_container(cfg.model, resolve=True), tag_dir)
    model = build_model(cfg.model, int(cfg.run.seed))  # frozen parts come from where training read them
    load_trained_weights(model, weights, f"the trained weights of {tag_dir}")
    if not hasattr(model, "merge_lora"):
        raise ExportError(f"--format hf: {type(model).__name__} (model.arch {cfg.model.arch}) is not a BLIP-2 "
                          "model with a language model; --format hf exports blip2_qwen models")
    model.merge_lora()  # Blip2ForConditionalGeneration has no adapters: LoRA and token rows go into the weights
    return model.eval()


def eval_image_processor(cfg: DictConfig) -> dict[str, Any]:
    """The eval image processor section lavis_ds.apps.generate would use (the first dataset's), or its default."""
    for section in (cfg.get("datasets") or {}).values():
        processor = (section.get("vis_processor") or {}).get("eval")
        if processor:
            return OmegaConf.to_container(processor, resolve=True)
    return {"name": EVAL_IMAGE_PROCESSOR, "image_size": int(cfg.model.image_size)}


# ----------------------------------------------------------------------------- the folder
def write_hf_folder(model: nn.Module, out: Path, image_cfg: dict[str, Any], trained_dtype: str = "fp32") -> list[str]:
    """Write model, generation config, tokenizer and processor of a checked, merged ``model`` into ``out``.

    ``trained_dtype``: the dtype training computed in (the checkpoint's ``fp32``/``bf16``/``fp16``).
    Returns notes: where the export computes differently from lavis_ds in ways that change no weight.
    """
    dtype = export_dtype(model, trained_dtype)
    hf_model = to_hf_model(model, dtype)
    hf_model.generation_config = generation_config(model)
    hf_model.save_pretrained(out)
    save_processor(model, image_cfg, out)
    return export_notes(model, dtype)


def export_dtype(model: nn.Module, trained_dtype: str) -> torch.dtype:
    """The one dtype every tensor is written in (from_pretrained loads a model in one, config.dtype).

    As ``load_exported(dtype="auto")``: a bf16/fp16 run's dtype, which its engine cast every parameter
    to. Otherwise the model's dtype, or fp32 where its parts differ (a frozen bf16 LLM beside fp32
    trained parts), which holds them all without rounding.
    """
    if trained_dtype in ("bf16", "fp16"):
        return DTYPES[trained_dtype]
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def blip2_config(model: nn.Module, dtype: torch.dtype):
    """The Blip2Config of ``model``: the LLM's own config as text_config, the image token's id as image_token_index."""
    from transformers import Blip2Config

    vit, llm = model.visual_encoder, model.llm_model
    block = vit.blocks[0]
    vision = {"hidden_size": vit.embed_dim, "intermediate_size": block.mlp.fc1.out_features,
              "num_hidden_layers": len(vit.blocks), "num_attention_heads": block.attn.num_heads,
              "image_size": vit.patch_embed.img_size[0], "patch_size": vit.patch_embed.patch_size[0],
              "hidden_act": activation_name(block.mlp.act), "layer_norm_eps": block.norm1.eps,
              "qkv_bias": block.attn.q_bias is not None}
    qformer = model.qformer.config.to_dict()
    # The LLM's generate reads its stop and pad ids from text_config (see generation_config).
    text = llm.config.to_dict() | {"eos_token_id": model.stop_token_ids(), "pad_token_id": model.pad_id}
    config = Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text,
                         num_query_tokens=model.query_tokens.shape[1],
                         image_token_index=model.prompt.image_token_id)
    config.dtype = dtype
    for sub in (config.vision_config, config.qformer_config, config.text_config):
        sub.dtype = dtype
    return config


def to_hf_model(model: nn.Module, dtype: torch.dtype):
    """A Blip2ForConditionalGeneration holding ``model``'s weights (in ``dtype``), every key accounted for."""
    from transformers import Blip2ForConditionalGeneration

    # Parameters on the meta device: they come from `model`, so no memory and no time for a random init.
    # Buffers stay real: rotary tables are computed at construction and are in no state dict.
    with empty_weights():
        hf_model = Blip2ForConditionalGeneration(blip2_config(model, dtype))
    state = {name: tensor.detach().to(dtype) for name, tensor in hf_state_dict(model).items()}
    expected = set(hf_model.state_dict())
    missing, unknown = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unknown:  # the mapping and transformers' class disagree: a bug here, not the user's
        raise RuntimeError(f"key mapping to Blip2ForConditionalGeneration: missing {missing[:8]}, "
                           f"unknown {unknown[:8]}")
    hf_model.load_state_dict(state, strict=True, assign=True)
    hf_model.tie_weights()  # a text_config with tie_word_embeddings shares one matrix again
    return hf_model.eval()


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under Blip2ForConditionalGeneration's names."""
    state = {f"vision_model.{k}": v for k, v in vision_state_dict(model.visual_encoder).items()}
    state |= {f"vision_model.post_layernorm.{k}": v for k, v in model.ln_vision.state_dict().items()}
    state |= {f"qformer.{k}": v for k, v in model.qformer.state_dict().items()}
    state["query_tokens"] = model.query_tokens
    state |= {f"language_projection.{k}": v for k, v in model.llm_proj.state_dict().items()}
    state |= {f"language_model.{k}": v for k, v in model.llm_model.state_dict().items()}
    return state


def vision_state_dict(vit: nn.Module) -> dict[str, torch.Tensor]:
    """The EVA ViT's weights under Blip2VisionModel's names (without ``post_layernorm``: that is ln_vision).

    timm keeps EVA's q and v biases as parameters and a zero k bias as a buffer; Blip2Attention has one
    qkv bias of [q, k, v], built the same way, so the three are concatenated in that order.
    """
    state = {}
    for key, value in vit.state_dict().items():
        if re.search(r"\.attn\.[qkv]_bias$", key):
            continue
        new = _rename_key(key, VISION_RENAMES)
        if new == key:
            raise RuntimeError(f"visual_encoder.{key}: no Blip2VisionModel name for it")  # checked layout: a bug
        state[new] = value
    for i, block in enumerate(vit.blocks):
        attn = block.attn
        if attn.q_bias is not None:
            k_bias = attn.k_bias if attn.k_bias is not None else torch.zeros_like(attn.q_bias)
            bias = torch.cat((attn.q_bias, k_bias.to(attn.q_bias.dtype), attn.v_bias))
            state[f"encoder.layers.{i}.self_attn.qkv.bias"] = bias
    return state


# ----------------------------------------------------------------------------- what differs without a weight
def export_notes(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Where the exported model computes differently from lavis_ds though every weight is the same."""
    notes = []
    vit_eps, ln_eps = model.visual_encoder.blocks[0].norm1.eps, model.ln_vision.eps
    if vit_eps != ln_eps:
        # Blip2VisionConfig has one layer_norm_eps for the blocks and post_layernorm; BLIP-2's ln_vision
        # is torch's default 1e-5, EVA's blocks 1e-6. transformers' script that converted LAVIS's BLIP-2
        # maps ln_vision onto post_layernorm the same way. Not refused: every BLIP-2 model has it.
        notes.append(f"ln_vision's LayerNorm eps {ln_eps:g} becomes post_layernorm with the ViT blocks' eps "
                     f"{vit_eps:g} (Blip2VisionConfig has one layer_norm_eps): each image feature changes by a "
                     f"factor sqrt((v + {ln_eps:g}) / (v + {vit_eps:g})), about {abs(ln_eps - vit_eps) / 2:g} / v "
                     "relative, v being its token's feature variance")
    if dtype != torch.float32:
        # transformers applies _keep_in_fp32_modules (query_tokens, qformer) to fp16 loads only.
        kept = (", keeps query_tokens and the Q-Former in fp32 (_keep_in_fp32_modules)"
                if dtype == torch.float16 else "")
        notes.append(f"written in {str(dtype).removeprefix('torch.')}: lavis_ds generates under autocast, "
                     f"transformers does not{kept}: texts may differ where two tokens are nearly tied")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {dtype}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        notes.append(f"parameters in {names} are written in {str(dtype).removeprefix('torch.')} "
                     "(from_pretrained loads one dtype; pass dtype= to choose another)")
    return notes

