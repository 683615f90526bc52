"""Export a checkpoint as the Hugging Face folder of its architecture's transformers class, which transformers
alone loads and runs.

``python export.py RUN --out DIR --format hf`` writes what ``<Class>.from_pretrained(DIR)`` and
``AutoProcessor.from_pretrained(DIR)`` read, with no lavis_ds import (docs/export-hf.md shows the lines a
transformers user writes). The class follows the model (``export_hf_checks.hf_family``):

    eva_vit_g + qformer (blip2_qwen)        Blip2ForConditionalGeneration + Blip2Processor
    eva_vit_g + instruct_qformer            InstructBlipForConditionalGeneration + InstructBlipProcessor
                                            (with the Q-Former's BERT tokenizer under qformer_tokenizer/)
    clip or siglip + mlp2x_gelu             LlavaForConditionalGeneration + LlavaProcessor
    qwen2_vl / qwen2_5_vl + patch_merger    Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration
                                            + their processors
    qwen3_vl + qwen3_vl_merger              Qwen3VLForConditionalGeneration + Qwen3VLProcessor
    qwen3_5 (the same parts, no DeepStack)  Qwen3_5ForConditionalGeneration + Qwen3VLProcessor (its own published
                                            chat template, the model's template variables as its defaults)

(each a registered family, ``lavis_ds.models.hf``; a new class is a new family there), and the folder holds:

    config.json, generation_config.json, model.safetensors   the model (the LLM's own config as text_config,
        LoRA and trained token rows merged into the LLM, the image token's id as image_token_index)
    tokenizer files, chat_template.jinja                      the tokenizer as the model used it; the chat
        template writes lavis_ds's ChatML prompt, image placeholders where training put them (the LLM's own
        template with the run's chat_template_kwargs as defaults, where they shaped the prompt)
    preprocessor_config.json, processor_config.json           the processor, its image processor set to the
        run's eval image processing
    lavis_ds_export.json                                      where it came from; ignored by transformers
    README.md                                                 the lines lmms-eval, vLLM and model cards run, and
        where they compute otherwise than lavis_ds (``export_hf_readme``)

The weight mappings, checks and processors live with each family (``lavis_ds.models.hf.blip``, ``.llava``,
``.qwen_vl``). What
the class cannot compute the same way, and any tower + connector pair no transformers class holds, is refused before
anything is written, every problem in one :class:`~lavis_ds.apps.export_io.ExportError` (exit 2 from the command
line). This module and those it uses import no command-line module (``tests/test_layers.py``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.apps.export_hf_checks import check_expressible
from lavis_ds.apps.export_hf_processor import default_image_cfg, generation_config, save_processor
from lavis_ds.apps.export_hf_readme import write_readme
from lavis_ds.apps.export_io import (DTYPES, ExportError, find_checkpoint, load_trained_weights, read_checkpoint,
                                     run_tokenizer, write_whole)
from lavis_ds.models.hf.family import HfFamily

MARKER_FILE = "lavis_ds_export.json"


# ----------------------------------------------------------------------------- the command's entry point
def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
              max_new_tokens: int | None = None) -> Path:
    """Write the Hugging Face folder (see the module docstring) of the checkpoint ``source`` names.

    Args:
        source: A checkpoint folder, or a run's output_dir (its newest complete checkpoint).
        out_dir: Folder to create; an existing non-empty one is replaced only if it is an earlier
            ``--format hf`` export and ``overwrite`` is true.
        max_new_tokens: The generation config's limit (None: the default of the model's ``generate``).

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
    family = check_expressible(model, image_cfg)

    def write(tmp: Path) -> None:
        notes = write_hf_folder(model, tmp, image_cfg, info["dtype"], max_new_tokens)
        provenance = {"source": str(tag_dir.resolve()), "global_step": info["global_step"], "epoch": info["epoch"],
                      "runner": info["runner"], "zero_stage": info["zero_stage"], "dtype": info["dtype"],
                      "architecture": family.hf_class, "notes": notes}
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
        raise ExportError(f"--format hf: {type(model).__name__} (model.arch {cfg.model.arch}) is not a vision-LLM "
                          "with a language model; --format hf exports blip2_qwen, llava and instructblip models")
    model.merge_lora()  # the transformers classes have no adapters: LoRA and token rows go into the weights
    return model.eval()


def eval_image_processor(cfg: DictConfig) -> dict[str, Any] | None:
    """The eval image processor section lavis_ds.apps.generate uses (the first dataset's); None if the run has none
    (generate then uses the model's own: ``export_hf_processor.default_image_cfg``)."""
    for section in (cfg.get("datasets") or {}).values():
        processor = (section.get("vis_processor") or {}).get("eval")
        if processor:
            return OmegaConf.to_container(processor, resolve=True)
    return None


# ----------------------------------------------------------------------------- the folder
def write_hf_folder(model: nn.Module, out: Path, image_cfg: dict[str, Any] | None = None,
                    trained_dtype: str = "fp32", max_new_tokens: int | None = None) -> list[str]:
    """Check ``model`` (merged, trained weights loaded), then write model, generation config, tokenizer and processor
    of its transformers class into ``out``.

    ``image_cfg``: the eval image processor section (None: the model's own, ``export_hf_processor.default_image_cfg``).
    ``trained_dtype``: the dtype training computed in (the checkpoint's ``fp32``/``bf16``/``fp16``).
    Returns notes: where the export computes differently from lavis_ds in ways that change no weight.
    """
    image_cfg = image_cfg or default_image_cfg(model)
    family = check_expressible(model, image_cfg)
    dtype = export_dtype(model, trained_dtype)
    hf_model = family.weights.to_hf_model(model, dtype)
    hf_model.generation_config = generation_config(model, max_new_tokens)
    hf_model.save_pretrained(out)
    variables = save_processor(model, image_cfg, out, family)
    notes = export_notes(model, dtype, family, type(hf_model)) + variables.notes
    write_readme(model, family, notes, out, variables.carried)
    return notes


def to_hf_model(model: nn.Module, dtype: torch.dtype):
    """The transformers model ``model`` exports to (checked first), in ``dtype``; nothing written."""
    return check_expressible(model).weights.to_hf_model(model, dtype)


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


# ----------------------------------------------------------------------------- what differs without a weight
def export_notes(model: nn.Module, dtype: torch.dtype, family: HfFamily, hf_class: type) -> list[str]:
    """Where the exported model (an ``hf_class`` of ``family``) computes differently from lavis_ds though every
    weight is the same."""
    notes = family.weights.export_notes(model, dtype)
    if dtype != torch.float32:
        # transformers applies _keep_in_fp32_modules (BLIP-2: query_tokens, qformer) to fp16 loads only.
        kept = getattr(hf_class, "_keep_in_fp32_modules", None) if dtype == torch.float16 else None
        kept = f", keeps {' and '.join(kept)} in fp32 (_keep_in_fp32_modules)" if kept else ""
        notes.append(f"written in {str(dtype).removeprefix('torch.')}: lavis_ds generates under autocast, "
                     f"transformers does not{kept}: texts may differ where two tokens are nearly tied")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {dtype}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        notes.append(f"parameters in {names} are written in {str(dtype).removeprefix('torch.')} "
                     "(from_pretrained loads one dtype; pass dtype= to choose another)")
    return notes
