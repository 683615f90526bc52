"""``export.py``: export a training checkpoint to safetensors (or, ``--format hf``, to its transformers class).

An export folder holds:

    model.safetensors   the trained parameters as fp32 master values; nothing frozen
    config.yaml         the run's model section, its seed, the eval processors, and what was exported
    tokenizer/          the tokenizer the model was built from
or, with ``--merge-lora``, instead of tokenizer/:
    llm/                the LLM as a plain Hugging Face folder (LoRA and trained token rows merged
                        in) with the tokenizer as the model used it; model.safetensors then holds
                        the trained weights outside the LLM

Either tokenizer's chat template defaults to the run's ``model.chat_template_kwargs`` (those it reads,
``lavis_ds.models.template_defaults``): ``tokenizer.apply_chat_template`` without them renders the prompts
the model trained on (Qwen3's empty think block of ``enable_thinking: false``). A variable the template
cannot default to is named in ``config.yaml``'s ``export.notes`` and printed.

Frozen parameters are left out, as in the checkpoints: :func:`load_exported` rebuilds
the model from ``config.yaml`` through the registry, which brings them from where
training had them (random init from ``seed``, or the files named by ``pretrained``,
``vit_pretrained`` and ``llm_model``), then loads ``model.safetensors`` over it.

Export reads the checkpoints of every engine, each through the engine that wrote it
(its ``checkpoints.read_trained_weights``: DeepSpeed's of every ZeRO stage and precision, FSDP's DCP folders).
Loading an export needs no engine and no process group. Reading checkpoints and loading exports live in
:mod:`lavis_ds.apps.export_io` (re-exported here), which imports no command-line module.

``export.py ... --format hf`` writes the architecture's transformers folder instead
(``Blip2ForConditionalGeneration``, ``LlavaForConditionalGeneration``, ``InstructBlipForConditionalGeneration``;
:mod:`lavis_ds.apps.export_hf`, docs/export-hf.md).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from lavis_ds.apps.export_io import (CONFIG_FILE, DTYPES, MERGED_LLM_DIR, TOKENIZER_DIR, WEIGHTS_FILE,  # noqa: F401
                                     ExportError, exported_model_config, find_checkpoint, is_export,
                                     load_exported, load_trained_weights, read_checkpoint, read_export_config,
                                     run_tokenizer, write_whole)
from lavis_ds.common.errors import LavisDsError, report
from lavis_ds.models.template_defaults import save_tokenizer_with_defaults


# ----------------------------------------------------------------------------- export
def export_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, merge_lora: bool = False,
                      overwrite: bool = False) -> Path:
    """Write the export folder (see the module docstring) for the checkpoint ``source`` names.

    Args:
        source: A checkpoint folder, or a run's output_dir (its newest complete checkpoint).
        out_dir: Folder to create. An existing non-empty one is replaced only if it is an
            earlier export and ``overwrite`` is true.
        merge_lora: Also write ``llm/``: the LLM with LoRA adapters and trained token rows
            merged (``VisionLLM.merge_lora``), loadable with ``from_pretrained``;
            ``model.safetensors`` then holds the trained weights outside the LLM.

    Returns:
        ``out_dir``. The folder appears whole or not at all (written beside it, then renamed).
    """
    tag_dir = find_checkpoint(source)
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    weights, info = read_checkpoint(tag_dir)
    cfg = info["config"]
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    tokenizer_source = run_tokenizer(model_cfg, tag_dir)
    # The tokenizer's chat template defaults to the run's template variables, so that a transformers user's
    # apply_chat_template renders the prompt the model trained on; lavis_ds passes them itself.
    variables = model_cfg.get("chat_template_kwargs") or {}

    def write(tmp: Path) -> None:
        nonlocal weights, model_cfg
        if merge_lora:
            weights, model_cfg, notes = _merge_llm(weights, model_cfg, int(cfg.run.seed), tmp, tag_dir)
        else:
            # The tokenizer as it was on disk, not as the model extended it: rebuilding from it adds
            # the same tokens and so makes the same modules (trainable rows for ChatML tokens it lacked).
            from transformers import AutoTokenizer

            notes = save_tokenizer_with_defaults(AutoTokenizer.from_pretrained(tokenizer_source), variables,
                                                 tmp / TOKENIZER_DIR)
            model_cfg["tokenizer"] = TOKENIZER_DIR
        _save_weights(weights, tmp / WEIGHTS_FILE, tag_dir, info)
        _write_config(tmp / CONFIG_FILE, model_cfg, cfg, tag_dir, info, merge_lora, notes)

    write_whole(out, write)
    return out



def _check_out_dir(out: Path, overwrite: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not is_export(out):
        raise ExportError(f"{out} exists and is not an export folder (no {WEIGHTS_FILE} and {CONFIG_FILE}): "
                          "choose a new --out folder")
    if not overwrite:
        raise ExportError(f"{out} already holds an export: choose a new --out folder or pass --overwrite")



def _merge_llm(weights: dict, model_cfg: dict, seed: int, out: Path,
               source: Path) -> tuple[dict, dict, list[str]]:
    """Write ``out/llm`` (merged LLM + tokenizer); return the weights and model config that go with it, and the
    notes on template variables its chat template cannot default to."""
    from lavis_ds.build import build_model

    model = build_model(OmegaConf.create(model_cfg), seed)  # as trained: the run's own tokenizer and folders
    load_trained_weights(model, weights, f"the trained weights of {source}")
    if not hasattr(model, "merge_lora"):
        raise ExportError(f"--merge-lora: {type(model).__name__} has no merge_lora(); export without it")
    llm = model.merge_lora()
    llm.save_pretrained(out / MERGED_LLM_DIR)
    # With the tokens the model added and the run's template variables as its template's defaults: HF-ready.
    notes = save_tokenizer_with_defaults(model.llm.tokenizer, model_cfg.get("chat_template_kwargs") or {},
                                         out / MERGED_LLM_DIR)
    # The model rebuilt from this export loads the merged LLM instead of building the random one: the connector
    # (the model names it) goes into the file even when it was frozen, so that it never depends on how the LLM
    # gets built.
    kept = {name: t for name, t in weights.items() if not name.startswith(model.LLM_PREFIX)}
    kept |= {name: p.detach().float() for name, p in model.named_parameters()
             if name.startswith(model.CONNECTOR_PREFIXES) and name not in kept}
    merged_cfg = model_cfg | type(model).SETTINGS.merged_llm_settings(MERGED_LLM_DIR)
    return kept, merged_cfg, notes


def _save_weights(weights: dict[str, torch.Tensor], path: Path, tag_dir: Path, info: dict) -> None:
    from safetensors.torch import save_file

    # safetensors refuses views into one flat buffer (what the ZeRO merge returns): one copy each.
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous().clone() for name, t in weights.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "source": str(tag_dir.resolve()),
                                            "global_step": str(info["global_step"])})
    # safetensors creates the file owner-only; an export is meant to be shared like the rest of the folder.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_config(path: Path, model_cfg: dict, cfg: DictConfig, tag_dir: Path, info: dict, merged: bool,
                  notes: list[str]) -> None:
    # Eval processors, and where the run's data was (builder and build_info, paths on the training machine):
    # `generate --data` on one of its annotation files finds the images there.
    datasets = {}
    for name, section in OmegaConf.to_container(cfg.datasets, resolve=True).items():
        kept = {kind: {"eval": section[kind]["eval"]} for kind in ("vis_processor", "text_processor")
                if (section.get(kind) or {}).get("eval")}
        if "build_info" in section:
            kept.update(builder=section.get("builder", name), build_info=section["build_info"])
        if kept:
            datasets[name] = kept
    content = {
        "model": model_cfg,
        "seed": int(cfg.run.seed),
        "datasets": datasets,
        "export": {"source": str(tag_dir.resolve()), "global_step": info["global_step"], "epoch": info["epoch"],
                   "runner": info["runner"], "zero_stage": info["zero_stage"], "dtype": info["dtype"],
                   "merged_llm": merged, "notes": notes},
    }
    header = ("# A lavis_ds export. load_exported() rebuilds model: (seeded with `seed`) and loads model.safetensors.\n"
              "# model.tokenizer (and model.llm_model with merged_llm) are relative to this folder; other paths\n"
              "# name frozen weights where training read them. export.dtype: the dtype the model trained and\n"
              "# generated in (the DeepSpeed engine cast its parameters); load_exported(dtype='auto') does the same.\n")
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(content)))


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lavis-ds export", description="Export a lavis_ds checkpoint (any ZeRO stage) to safetensors for "
        "inference without DeepSpeed. Load it with lavis_ds.apps.export.load_exported or `lavis-ds generate`; "
        "with --format hf, with transformers' class of its architecture (docs/export-hf.md).")
    parser.add_argument("source", help="a checkpoint folder (<output_dir>/checkpoints/step_<N>) or a run's "
                                       "output_dir (its newest complete checkpoint)")
    parser.add_argument("--out", required=True, help="export folder to create")
    parser.add_argument("--format", choices=("lavis_ds", "hf"), default="lavis_ds",
                        help="lavis_ds: trained weights + config for lavis_ds (default); hf: a Hugging Face folder "
                             "of the architecture's transformers class (Blip2ForConditionalGeneration, "
                             "LlavaForConditionalGeneration, InstructBlipForConditionalGeneration) with its "
                             "processor, LoRA merged")
    parser.add_argument("--merge-lora", action="store_true",
                        help="also write llm/: the LLM with LoRA (and trained token rows) merged, as a Hugging Face "
                             "folder (--format hf always merges)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    args = parser.parse_args(argv)
    try:
        if args.format == "hf":
            return _export_hf(args)
        out = export_checkpoint(args.source, args.out, merge_lora=args.merge_lora, overwrite=args.overwrite)
    except LavisDsError as e:  # ExportError, CheckpointError: the message names the path
        report(str(e))
        return e.exit_code
    export = read_export_config(out).export
    print(f"exported {export.source} (step {export.global_step}, {_engine(export)}, {export.dtype}) -> {out}")
    for note in export.get("notes") or []:
        print(f"note: {note}")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    import json

    from lavis_ds.apps.export_hf import MARKER_FILE, export_hf  # transformers' model classes: imported when used
    from lavis_ds.apps.generation import GenerationSettings

    # The generation config answers with as many new tokens as `python -m lavis_ds.apps.generate` does by default.
    out = export_hf(args.source, args.out, overwrite=args.overwrite,
                    max_new_tokens=GenerationSettings().max_new_tokens)
    export = OmegaConf.create(json.loads((out / MARKER_FILE).read_text()))
    print(f"exported {export.source} (step {export.global_step}, {_engine(export)}, {export.dtype}) -> {out} "
          f"(transformers {export.architecture})")
    for note in export.notes:
        print(f"note: {note}")
    return 0


def _engine(export: DictConfig) -> str:
    return "FSDP2" if export.get("runner") == "runner_fsdp" else f"ZeRO-{export.zero_stage}"
