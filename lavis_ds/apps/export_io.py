"""Reading checkpoints and loading exports: the export library's half that every export format and every app uses.

Finding a run's newest complete checkpoint, reading its trained weights through the engine that wrote it,
copying them into a rebuilt model with strict accounting, writing a folder whole or not at all, and loading a
``--format lavis_ds`` export (:func:`load_exported`; the folder's format itself is ``lavis_ds.models.export_folder``,
which the build reads too). Nothing here parses a command line: ``lavis_ds.apps.export``
(``export.py``), ``lavis_ds.apps.export_hf`` (``--format hf``), generate, chat and the web page import it, and it
imports none of them.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.common import safe_files
from lavis_ds.common.registry import engines as engine_registry
from lavis_ds.models.export_folder import (CONFIG_FILE, WEIGHTS_FILE, ExportError, is_export,  # noqa: F401
                                           load_trained_weights, read_export_config)
from lavis_ds.runners import checkpoint as ckpt

TOKENIZER_DIR = "tokenizer"
MERGED_LLM_DIR = "llm"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    if (path / "config.json").is_file():  # a `--format hf` export or a published folder: transformers' format
        found += (" but a transformers model's folder (config.json), as `--format hf` writes: transformers and "
                  "lmms-eval's own models read it (docs/models.md), lavis_ds reads the run it was exported from or "
                  "its `--format lavis_ds` export")
    raise ExportError(f"{path} is not a lavis_ds checkpoint{found}: give a checkpoint folder "
                      f"<output_dir>/checkpoints/step_<N> holding {ckpt.COMPLETE_MARKER}, or a run's output_dir "
                      f"(its newest complete checkpoint is exported)")


def _is_checkpoint_folder(path: Path) -> bool:
    return path.is_dir() and ckpt.looks_like_checkpoint(path)


# ----------------------------------------------------------------------------- reading the trained weights
def read_checkpoint(tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(trained fp32 weights by parameter name, info)`` of a complete checkpoint folder.

    ``info`` has the run ``config`` (DictConfig), ``runner`` (the engine that wrote it), ``zero_stage``
    (DeepSpeed's; None under FSDP), ``dtype`` (the engine's: fp32/bf16/fp16), ``global_step``, ``epoch`` and
    ``world_size``.
    """
    writer = ckpt.writer_of(tag_dir)
    if writer not in engine_registry:
        raise ExportError(f"{tag_dir} was written by {writer}, which is not a registered engine here "
                          f"(known: {', '.join(engine_registry)})")
    # Each engine reads its own files (the DeepSpeed engine: its consolidation of the fp32 partitions).
    weights, client_state, layout = engine_registry.get(writer).checkpoints.read_trained_weights(tag_dir)
    return weights, _info(tag_dir, client_state, writer, layout.get("zero_stage"), layout["precision"])


def _info(tag_dir: Path, client_state: dict, writer: str, zero_stage: int | None, dtype: str) -> dict[str, Any]:
    """``read_checkpoint``'s info, from the client state the engine saved (its ``lavis_ds`` key)."""
    config = ckpt.saved_config(tag_dir, client_state)
    client = client_state["lavis_ds"]
    train_state = client.get("train_state", {})
    return {"config": config, "runner": writer, "zero_stage": zero_stage, "dtype": dtype,
            "world_size": client.get("world_size"), "global_step": train_state.get("global_step"),
            "epoch": train_state.get("epoch")}




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



# ----------------------------------------------------------------------------- loading
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
    folder = Path(folder)
    cfg = read_export_config(folder)
    return _rebuilt(exported_model_config(folder), int(cfg.seed), _read_weights(folder / WEIGHTS_FILE),
                    str(folder / WEIGHTS_FILE), cfg.export.get("dtype", "fp32") if dtype == "auto" else dtype, device)


def load_trained(path: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "auto") -> tuple[nn.Module, DictConfig]:
    """``(model in eval mode, config)`` for an export folder, a checkpoint folder or a run's output_dir (its newest
    complete checkpoint, :func:`find_checkpoint`), without writing anything. ``config``: the export's config.yaml or
    the run's config (both hold the ``datasets`` eval processors and the ``model`` section). ``dtype`` as
    :func:`load_exported`'s (``auto``: the checkpoint's engine dtype)."""
    if is_export(path):
        return load_exported(path, device, dtype), read_export_config(path)
    tag_dir = find_checkpoint(path)
    weights, info = read_checkpoint(tag_dir)
    cfg = info["config"]
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_cfg["tokenizer"] = run_tokenizer(model_cfg, tag_dir)
    model = _rebuilt(OmegaConf.create(model_cfg), int(cfg.run.seed), weights, f"the trained weights of {tag_dir}",
                     info["dtype"] if dtype == "auto" else dtype, device)
    return model, cfg


def _rebuilt(model_cfg: DictConfig, seed: int, weights: dict[str, torch.Tensor], source: str,
             dtype: str | torch.dtype, device: str | torch.device) -> nn.Module:
    """The model built from ``model_cfg`` through the registry with ``weights`` loaded, cast to ``dtype``."""
    import lavis_ds.models  # noqa: F401  (registers the models)
    from lavis_ds.build import build_model

    model = build_model(model_cfg, seed)
    load_trained_weights(model, weights, source)
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


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """An export's ``model.safetensors`` (a format that holds tensors and nothing that runs); a file that is not one
    is named, and a pickle put in its place is refused without being read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as e:
        unsafe = safe_files.pickle_in_place_of(path, "safetensors")
        if unsafe is not None:
            raise unsafe from None
        raise ExportError(f"{path}: not a safetensors file ({e}); an export's weights are the model.safetensors "
                          "that export.py writes: export the checkpoint again") from None
