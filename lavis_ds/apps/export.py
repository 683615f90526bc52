"""Export a training checkpoint to safetensors, and load the export for inference without DeepSpeed.

An export folder holds:

    model.safetensors   the trained parameters as fp32 master values; nothing frozen
    config.yaml         the run's model section, its seed, the eval processors, and what was exported
    tokenizer/          the tokenizer the model was built from
or, with ``--merge-lora``, instead of tokenizer/:
    llm/                the LLM as a plain Hugging Face folder (LoRA and trained token rows merged
                        in) with the tokenizer as the model used it; model.safetensors then holds
                        the trained weights outside the LLM

Frozen parameters are left out, as in the checkpoints: :func:`load_exported` rebuilds
the model from ``config.yaml`` through the registry, which brings them from where
training had them (random init from ``seed``, or the files named by ``pretrained``,
``vit_pretrained`` and ``llm_model``), then loads ``model.safetensors`` over it.

Export reads the checkpoints of every runner, each through the runner that wrote it
(``read_trained_weights``: DeepSpeed's of every ZeRO stage and precision, FSDP's DCP folders).
Loading an export needs no engine and no process group.

``export.py ... --format hf`` writes a transformers ``Blip2ForConditionalGeneration`` folder instead
(:mod:`lavis_ds.apps.export_hf`, docs/export-hf.md).
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.common.errors import InputError, LavisDsError, report
from lavis_ds.common.registry import runners as runner_registry
from lavis_ds.runners import checkpoint as ckpt

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"
MERGED_LLM_DIR = "llm"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ExportError(InputError, ValueError):
    """A checkpoint that cannot be exported or an export that cannot be loaded; the message names the path."""


# ----------------------------------------------------------------------------- finding the checkpoint
def find_checkpoint(path: str | os.PathLike) -> Path:
    """The complete checkpoint folder that ``path`` names.

    ``path`` is a checkpoint folder (``<output_dir>/checkpoints/step_<N>``), a run's
    ``output_dir`` or its ``checkpoints/`` folder; the last two mean their newest
    complete checkpoint. Raises :class:`ExportError` for an incomplete checkpoint
    (no completion marker: some rank never finished writing it) and for anything else.
    """
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path} does not exist")
    if ckpt.is_complete(path):
        return path
    if _is_checkpoint_folder(path):
        newest = ckpt.latest_complete(path.parent)
        hint = f"; the newest complete checkpoint beside it is {newest}" if newest else ""
        raise ExportError(f"{path} is an incomplete checkpoint: it has no {ckpt.COMPLETE_MARKER}, so not every "
                          f"rank finished writing it (the run was stopped while saving){hint}")
    for folder in (path / "checkpoints", path):
        newest = ckpt.latest_complete(folder)
        if newest is not None:
            return newest
    incomplete = sorted(str(p) for folder in (path / "checkpoints", path) if folder.is_dir()
                        for p in folder.iterdir() if p.is_dir() and _is_checkpoint_folder(p))
    found = f" (only incomplete checkpoints: {', '.join(incomplete)})" if incomplete else ""
    raise ExportError(f"{path} is not a lavis_ds checkpoint{found}: give a checkpoint folder "
                      f"<output_dir>/checkpoints/step_<N> holding {ckpt.COMPLETE_MARKER}, or a run's output_dir "
                      f"(its newest complete checkpoint is exported)")


def _is_checkpoint_folder(path: Path) -> bool:
    return path.is_dir() and ckpt.looks_like_checkpoint(path)


# ----------------------------------------------------------------------------- reading the trained weights
def read_checkpoint(tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(trained fp32 weights by parameter name, info)`` of a complete checkpoint folder.

    ``info`` has the run ``config`` (DictConfig), ``runner``, ``zero_stage`` (DeepSpeed's; None under FSDP),
    ``dtype`` (the engine's: fp32/bf16/fp16), ``global_step``, ``epoch`` and ``world_size``.
    """
    writer = ckpt.writer_of(tag_dir)
    if writer not in runner_registry:
        raise ExportError(f"{tag_dir} was written by {writer}, which is not a registered runner here "
                          f"(known: {', '.join(runner_registry)})")
    # Each engine reads its own files (the DeepSpeed runner: its consolidation of the fp32 partitions).
    weights, client_state, layout = runner_registry.get(writer).read_trained_weights(tag_dir)
    return weights, _info(tag_dir, client_state, writer, layout.get("zero_stage"), layout["precision"])


def _info(tag_dir: Path, client_state: dict, runner: str, zero_stage: int | None, dtype: str) -> dict[str, Any]:
    """``read_checkpoint``'s info, from the client state the runner saved (its ``lavis_ds`` key)."""
    config = ckpt.saved_config(tag_dir, client_state)
    client = client_state["lavis_ds"]
    train_state = client.get("train_state", {})
    return {"config": config, "runner": runner, "zero_stage": zero_stage, "dtype": dtype,
            "world_size": client.get("world_size"), "global_step": train_state.get("global_step"),
            "epoch": train_state.get("epoch")}




# ----------------------------------------------------------------------------- export
def export_checkpoint(source: str | os.PathLike, out_dir: str | os.PathLike, merge_lora: bool = False,
                      overwrite: bool = False) -> Path:
    """Write the export folder (see the module docstring) for the checkpoint ``source`` names.

    Args:
        source: A checkpoint folder, or a run's output_dir (its newest complete checkpoint).
        out_dir: Folder to create. An existing non-empty one is replaced only if it is an
            earlier export and ``overwrite`` is true.
        merge_lora: Also write ``llm/``: the LLM with LoRA adapters and trained token rows
            merged (``Blip2Qwen.merge_lora``), loadable with ``from_pretrained``;
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

    def write(tmp: Path) -> None:
        nonlocal weights, model_cfg
        if merge_lora:
            weights, model_cfg = _merge_llm(weights, model_cfg, int(cfg.run.seed), tmp, tag_dir)
        else:
            # The tokenizer as it was on disk, not as the model extended it: rebuilding from it adds
            # the same tokens and so makes the same modules (trainable rows for ChatML tokens it lacked).
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(tmp / TOKENIZER_DIR)
            model_cfg["tokenizer"] = TOKENIZER_DIR
        _save_weights(weights, tmp / WEIGHTS_FILE, tag_dir, info)
        _write_config(tmp / CONFIG_FILE, model_cfg, cfg, tag_dir, info, merge_lora)

    write_whole(out, write)
    return out


def run_tokenizer(model_cfg: dict, tag_dir: Path) -> str:
    """The run's tokenizer folder (``model.tokenizer``, else ``model.llm_model``): export rebuilds the model with it."""
    source = model_cfg.get("tokenizer") or model_cfg.get("llm_model")
    if not source or not Path(source).exists():
        raise ExportError(f"model.tokenizer (or model.llm_model) of {tag_dir}'s run config is {source!r}, "
                          "which does not exist here: export where the run's tokenizer is")
    return source


def write_whole(out: Path, write) -> None:
    """Call ``write(folder)`` on a folder beside ``out``, then rename it to ``out``: an export is whole or absent.

    An existing ``out`` is replaced (the caller checked that it may be). mkdir, unlike mkdtemp, leaves the
    permissions to the umask.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier attempt of a process with our pid
    tmp.mkdir()
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not is_export(out):
        raise ExportError(f"{out} exists and is not an export folder (no {WEIGHTS_FILE} and {CONFIG_FILE}): "
                          "choose a new --out folder")
    if not overwrite:
        raise ExportError(f"{out} already holds an export: choose a new --out folder or pass --overwrite")


def is_export(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return (folder / WEIGHTS_FILE).is_file() and (folder / CONFIG_FILE).is_file()


def _merge_llm(weights: dict, model_cfg: dict, seed: int, out: Path, source: Path) -> tuple[dict, dict]:
    """Write ``out/llm`` (merged LLM + tokenizer); return the weights and model config that go with it."""
    from lavis_ds.build import build_model

    model = build_model(OmegaConf.create(model_cfg), seed)  # as trained: the run's own tokenizer and folders
    load_trained_weights(model, weights, f"the trained weights of {source}")
    if not hasattr(model, "merge_lora"):
        raise ExportError(f"--merge-lora: {type(model).__name__} has no merge_lora(); export without it")
    llm = model.merge_lora()
    llm.save_pretrained(out / MERGED_LLM_DIR)
    model.llm_tokenizer.save_pretrained(out / MERGED_LLM_DIR)  # with the tokens the model added: HF-ready
    # The model rebuilt from this export loads the merged LLM instead of building the random one: the connector
    # (the model names it) goes into the file even when it was frozen, so that it never depends on how the LLM
    # gets built.
    kept = {name: t for name, t in weights.items() if not name.startswith(model.LLM_PREFIX)}
    kept |= {name: p.detach().float() for name, p in model.named_parameters()
             if name.startswith(model.CONNECTOR_PREFIXES) and name not in kept}
    merged_cfg = model_cfg | model.merged_llm_settings(MERGED_LLM_DIR)
    return kept, merged_cfg


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


def _write_config(path: Path, model_cfg: dict, cfg: DictConfig, tag_dir: Path, info: dict, merged: bool) -> None:
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
                   "merged_llm": merged},
    }
    header = ("# A lavis_ds export. load_exported() rebuilds model: (seeded with `seed`) and loads model.safetensors.\n"
              "# model.tokenizer (and model.llm_model with merged_llm) are relative to this folder; other paths\n"
              "# name frozen weights where training read them. export.dtype: the dtype the model trained and\n"
              "# generated in (the DeepSpeed engine cast its parameters); load_exported(dtype='auto') does the same.\n")
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(content)))


# ----------------------------------------------------------------------------- loading
def read_export_config(folder: str | os.PathLike) -> DictConfig:
    """``config.yaml`` of an export folder; a clear error if ``folder`` is not one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not an export folder (it does not exist)")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise ExportError(f"{folder} is not an export folder: {' and '.join(missing)} missing "
                          "(make one with `python export.py <checkpoint or run dir> --out <folder>`)")
    cfg = OmegaConf.load(folder / CONFIG_FILE)
    absent = [key for key in ("model", "seed", "export") if key not in cfg]
    if absent:
        raise ExportError(f"{folder / CONFIG_FILE}: key(s) {', '.join(absent)} missing; not written by lavis_ds export")
    return cfg


def exported_model_config(folder: str | os.PathLike) -> DictConfig:
    """The exported model section with its folder-relative paths made absolute and frozen-weight paths checked."""
    folder = Path(folder)
    cfg = read_export_config(folder)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["tokenizer"] = str(folder / model["tokenizer"])
    if cfg.export.get("merged_llm"):
        model["llm_model"] = str(folder / model["llm_model"])
    sources = ["llm_model", "vit_pretrained"] + (["pretrained"] if model.get("load_pretrained") else [])
    for key in sources:
        if model.get(key) and not Path(os.path.expanduser(model[key])).exists():
            raise ExportError(f"model.{key}: {model[key]!r} does not exist. An export holds only trained weights; "
                              "frozen ones load from where training read them: make that path available here, "
                              f"or point model.{key} in {folder / CONFIG_FILE} at a copy")
    return OmegaConf.create(model)


def load_trained_weights(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``weights`` into ``model``'s parameters, with strict accounting.

    Every key must name a parameter of ``model`` (trainable or not) of the same shape,
    and every trainable parameter must be in ``weights``; otherwise :class:`ExportError`
    lists the offending names. Frozen parameters not in ``weights`` keep the values the
    model was built with.
    """
    present = dict(model.named_parameters(remove_duplicate=False))  # a tied alias is a present name too
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    problems = []
    unknown = sorted(set(weights) - set(present))
    if unknown:
        problems.append(f"{len(unknown)} key(s) name no parameter of the rebuilt {type(model).__name__}: "
                        + _names(unknown))
    missing = [name for name in trainable if name not in weights]
    if missing:
        problems.append(f"{len(missing)} trainable parameter(s) are not in the file (they would keep their "
                        f"initial values): {_names(missing)}")
    shapes = [f"{name} {tuple(weights[name].shape)} vs {tuple(present[name].shape)}"
              for name in weights if name in present and weights[name].shape != present[name].shape]
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es) (file vs model): {_names(shapes)}")
    if problems:
        raise ExportError(f"{source} does not fit the model built from its config:\n  - " + "\n  - ".join(problems)
                          + "\nThe weights and config.yaml must come from one export (was either edited or replaced?)")
    with torch.no_grad():
        for name, tensor in weights.items():
            present[name].copy_(tensor)  # into the parameter's own dtype and device


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_exported(folder: str | os.PathLike, device: str | torch.device = "cpu",
                  dtype: str | torch.dtype = "auto") -> nn.Module:
    """Rebuild an exported model through the registry, load its trained weights, return it in eval mode.

    Args:
        folder: An export folder (``python export.py ... --out folder``).
        device: Where to put the model.
        dtype: ``auto`` = the dtype it trained in (``export.dtype``): a bf16/fp16 run's engine cast
            every parameter, so casting them the same way reproduces what training computed;
            ``fp32`` keeps the dtypes the model is built with. Or ``bf16``/``fp16``/a torch dtype.
    """
    import lavis_ds.models  # noqa: F401  (registers the models)
    from lavis_ds.build import build_model
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_export_config(folder)
    model = build_model(exported_model_config(folder), int(cfg.seed))
    load_trained_weights(model, load_file(str(folder / WEIGHTS_FILE)), str(folder / WEIGHTS_FILE))
    if dtype == "auto":
        dtype = cfg.export.get("dtype", "fp32")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ExportError(f"dtype {dtype!r}: expected auto, {', '.join(DTYPES)} or a torch dtype")
        dtype = DTYPES[dtype]
    if dtype != torch.float32:
        # As DeepSpeed's bf16/fp16 engine casts a module: parameters only; buffers (rotary
        # frequencies, ...) keep their dtype. Casting those too changes the outputs.
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    return model.to(device).eval()


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="export.py", description="Export a lavis_ds checkpoint (any ZeRO stage) to safetensors for inference "
        "without DeepSpeed. Load it with lavis_ds.apps.export.load_exported or `python -m lavis_ds.apps.generate`; "
        "with --format hf, with transformers' Blip2ForConditionalGeneration (docs/export-hf.md).")
    parser.add_argument("source", help="a checkpoint folder (<output_dir>/checkpoints/step_<N>) or a run's "
                                       "output_dir (its newest complete checkpoint)")
    parser.add_argument("--out", required=True, help="export folder to create")
    parser.add_argument("--format", choices=("lavis_ds", "hf"), default="lavis_ds",
                        help="lavis_ds: trained weights + config for lavis_ds (default); hf: a Hugging Face "
                             "Blip2ForConditionalGeneration folder with its processor, LoRA merged")
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
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    import json

    from lavis_ds.apps.export_hf import MARKER_FILE, export_hf  # imports this module: imported when used

    out = export_hf(args.source, args.out, overwrite=args.overwrite)
    export = OmegaConf.create(json.loads((out / MARKER_FILE).read_text()))
    print(f"exported {export.source} (step {export.global_step}, {_engine(export)}, {export.dtype}) -> {out} "
          "(transformers Blip2ForConditionalGeneration)")
    for note in export.notes:
        print(f"note: {note}")
    return 0


def _engine(export: DictConfig) -> str:
    return "FSDP2" if export.get("runner") == "runner_fsdp" else f"ZeRO-{export.zero_stage}"
