"""Checkpoint folders on disk: naming, completeness markers, RNG states.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/``. DeepSpeed writes its
files there from every rank; after all ranks are done, rank 0 writes
``lavis_ds_complete.json``. Only folders with that marker are ever resumed
from, so a run killed mid-save falls back to the previous checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

COMPLETE_MARKER = "lavis_ds_complete.json"
_TAG = re.compile(r"^step_(\d+)$")


def tag_for(global_step: int) -> str:
    return f"step_{global_step}"


def is_complete(tag_dir: Path) -> bool:
    return (Path(tag_dir) / COMPLETE_MARKER).is_file()


def latest_complete(ckpt_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``ckpt_dir``, if any."""
    if not Path(ckpt_dir).is_dir():
        return None
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).iterdir()
             if (m := _TAG.match(p.name)) and is_complete(p)]
    return max(found)[1] if found else None


def read_marker(tag_dir: Path) -> dict:
    """What ``mark_complete`` recorded about a checkpoint (step, epoch, world size, global batch...)."""
    return json.loads((Path(tag_dir) / COMPLETE_MARKER).read_text())


def mark_complete(tag_dir: Path, info: dict) -> None:
    tmp = Path(tag_dir) / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, Path(tag_dir) / COMPLETE_MARKER)  # atomic: the marker is whole or absent


def rng_states() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_states(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def rng_file(tag_dir: Path, rank: int) -> Path:
    return Path(tag_dir) / f"rng_state_rank{rank}.pt"


def prune(ckpt_dir: Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and ``keep``); return what went.

    Unfinished folders older than the newest complete one (left by a crash while
    saving) go too. A folder is first renamed out of the ``step_<N>`` namespace,
    atomically, so a kill during the deletion never leaves a marked but gutted
    checkpoint for resume to trust.
    """
    steps = sorted((int(m.group(1)), p) for p in Path(ckpt_dir).iterdir() if (m := _TAG.match(p.name)))
    complete = [p for _, p in steps if is_complete(p)]
    if not complete:
        return []
    kept = set(complete[-keep_last:]) | ({Path(keep)} if keep else set())
    newest = int(_TAG.match(complete[-1].name).group(1))
    doomed = [p for step, p in steps if p not in kept and (is_complete(p) or step < newest)]
    _delete(doomed, ckpt_dir)
    return doomed


def discard_incomplete(ckpt_dir: Path) -> list[Path]:
    """Delete the folders of saves that never completed (a resume starts before them)."""
    if not Path(ckpt_dir).is_dir():
        return []
    torn = [p for p in Path(ckpt_dir).iterdir() if _TAG.match(p.name) and not is_complete(p)]
    _delete(torn, ckpt_dir)
    return torn


def _delete(folders: list[Path], ckpt_dir: Path) -> None:
    for path in folders:
        trash = path.with_name(f".deleting-{path.name}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    for trash in Path(ckpt_dir).glob(".deleting-*"):  # a deletion that a kill interrupted
        shutil.rmtree(trash, ignore_errors=True)


def best(ckpt_dir: Path) -> Path | None:
    """The complete checkpoint with the lowest validation loss recorded in its marker, if any."""
    scored = [(loss, p) for p in Path(ckpt_dir).iterdir()
              if _TAG.match(p.name) and is_complete(p) and (loss := read_marker(p).get("val_loss")) is not None]
    return min(scored)[1] if scored else None


def model_states_file(tag_dir: Path) -> Path:
    """The DeepSpeed file holding the module state dict (ZeRO-3 names it per data-parallel rank)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (Path(tag_dir) / name).is_file():
            return Path(tag_dir) / name
    raise FileNotFoundError(f"{tag_dir}: no DeepSpeed model states file (mp_rank_00_model_states.pt); "
                            "is this a DeepSpeed checkpoint folder?")


def check_trainable_saved(tag_dir: Path, trainable: list[str]) -> None:
    """Fail clearly if the checkpoint lacks trainable parameters of the model being resumed.

    The engine loads lean checkpoints non-strictly (frozen weights are absent on
    purpose), which would silently leave a missing trainable weight at its initial
    value, e.g. after changing which parts are frozen between runs.
    """
    # mmap: only the key index is read, not the tensors.
    saved = torch.load(model_states_file(tag_dir), map_location="cpu", mmap=True, weights_only=False)["module"]
    missing = [name for name in trainable if name not in saved]
    if missing:
        raise ValueError(
            f"{tag_dir} lacks {len(missing)} trainable parameter(s) of this model, e.g. {', '.join(missing[:5])}; "
            "it was saved from a model with other trainable parts (check the freeze_* / get_lora settings)")


def universal_copy(tag_dir: Path, universal_root: Path, rank: int) -> Path:
    """DeepSpeed's universal (world-size independent) form of ``tag_dir``; returns its load dir.

    Made afresh for every elastic resume (a lean checkpoint converts in seconds) and
    deleted once loaded, so a copy can never be stale. Rank 0 converts into a scratch
    folder and renames it into place: a kill during conversion leaves no half-made copy.
    """
    import torch.distributed as torch_dist

    target = Path(universal_root) / Path(tag_dir).name
    if rank == 0:
        from argparse import Namespace

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        if target.is_dir():  # left by a kill between this conversion and its load
            remove_universal_copy(target)
        scratch = target.with_name(f".tmp-{target.name}")
        shutil.rmtree(scratch, ignore_errors=True)
        ds_to_universal(Namespace(input_folder=str(tag_dir), output_folder=str(scratch), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True))
        _readable_by_every_stage(scratch)
        os.replace(scratch, target)
    if torch_dist.is_initialized():
        torch_dist.barrier()
    return target.parent


def _readable_by_every_stage(folder: Path) -> None:
    """Let a universal copy be loaded by any ZeRO stage 1-3, whichever stage saved it.

    A universal copy restores weights and Adam moments per parameter from ``zero/<name>/``; the
    rest is stage-specific bookkeeping, which ``ds_to_universal`` writes in the saving stage's form:
    - the module-states file (read for client state only) is found by a stage-specific name,
      ``zero_pp_rank_0_mp_rank_00_model_states.pt`` for ZeRO-3, ``mp_rank_00_model_states.pt`` below;
    - ``zero/optimizer_state.pt``: stages 1-2 read its top-level ``param_groups`` and ``ds_version``
      (a ZeRO-3 save lacks the latter), ZeRO-3 reads ``optimizer_state_dict`` (its param groups and the
      Adam step), which a stage 1-2 save lacks;
    - each parameter's ``fp32``/``exp_avg``/``exp_avg_sq``: ZeRO-3 writes flat tensors, stages 1-2
      read ``{"param": tensor}`` in the parameter's shape (ZeRO-3 reads both forms), and a ``step``
      file that ZeRO-3 does not write.
    """
    names = [folder / "mp_rank_00_model_states.pt", folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    present = next((path for path in names if path.is_file()), None)
    for path in names:
        if present is not None and not path.exists():
            os.link(present, path)
    optimizer_file = folder / "zero" / "optimizer_state.pt"
    state = torch.load(optimizer_file, map_location="cpu", weights_only=False)
    before = set(state)
    if "optimizer_state_dict" not in state:
        step_file = next((folder / "zero").glob("*/step.pt"), None)
        step = torch.load(step_file, weights_only=False) if step_file else 0
        state["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": state["param_groups"]}
    if "ds_version" not in state:  # stages 1-2 refuse a file without it; a ZeRO-3 save does not write it
        from deepspeed import __version__

        state["ds_version"] = __version__
    if set(state) != before:
        torch.save(state, optimizer_file)
    # Per-parameter states: ZeRO-3 writes flat tensors, stages 1-2 read {"param": tensor of the parameter's shape}.
    shapes = {name: shape for group in torch.load(present, map_location="cpu", mmap=True, weights_only=False)
              ["param_shapes"] for name, shape in group.items()}
    step = state["optimizer_state_dict"]["state"][0]["step"]
    for name, shape in shapes.items():
        if not (folder / "zero" / name / "step.pt").is_file():  # a ZeRO-3 save keeps the step in one place only
            torch.save(step, folder / "zero" / name / "step.pt")
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = folder / "zero" / name / f"{key}.pt"
            value = torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
            if torch.is_tensor(value):
                torch.save({"param": value.view(shape)}, path)


def remove_universal_copy(target: Path) -> None:
    """Delete a universal copy once loaded; renamed first, so a kill mid-way never leaves a gutted one in place."""
    _delete([Path(target)], Path(target).parent)
    (Path(target).parent / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer to it
