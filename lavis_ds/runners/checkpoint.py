"""Checkpoint folders on disk, whatever engine fills them: naming, completeness markers, RNG states.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/``. The engine writes its
files there from every rank; after all ranks are done, rank 0 writes
``lavis_ds_complete.json``, which names the engine that wrote the folder. Only folders
with that marker are ever resumed from, so a run killed mid-save falls back to the
previous checkpoint. What is inside is each engine's own (its engine class reads it).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from lavis_ds.common import dist, safe_files
from lavis_ds.common.errors import CheckpointError, LavisDsError  # noqa: F401  (CheckpointError: ckpt.CheckpointError)
from lavis_ds.common.registry import engines as engine_registry
from lavis_ds.common.renamed_keys import renamed

COMPLETE_MARKER = "lavis_ds_complete.json"
DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint is renamed out of the step_<N> namespace, never deleted
_TAG = re.compile(r"^step_(\d+)$")


@dataclass
class Handover:
    """A checkpoint's trained state as another engine takes it over: per parameter, whole (not sharded), in fp32."""

    states: dict[str, dict[str, torch.Tensor]]  # parameter name -> {"fp32", "exp_avg", "exp_avg_sq"}
    step: int  # AdamW steps taken (the t of its bias correction)
    client_state: dict  # what the loop saved beside it (its "lavis_ds" key)


class SaveFailed(LavisDsError):
    """A checkpoint could not be written (a full disk, an exceeded quota, a failing device): a fault, exit 1."""


# torch.save's C++ writer reports a short write (a full disk...) as a RuntimeError with no errno, e.g.
# "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
# or "[enforce fail at inline_container.cc:...] . PytorchStreamWriter failed writing file data/0: file write failed".
_TORCH_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing", "file write failed")


def save_failure(error: BaseException, tag_dir: Path) -> SaveFailed | None:
    """The one clear error for a checkpoint that could not be written: the folder, why, the space left and the
    last good checkpoint. None if ``error`` is no write failure (a bug keeps its traceback)."""
    tag_dir = Path(tag_dir)
    if isinstance(error, OSError):
        cause = f"{error.strerror or error} ({error.filename or tag_dir})"
    elif isinstance(error, RuntimeError) and any(part in str(error) for part in _TORCH_SHORT_WRITE):
        cause = (f"torch.save stopped short writing one of its files ({str(error).splitlines()[0].strip()!r}), as it "
                 "does when the disk is full or a quota is exceeded")
    else:
        return None
    latest = latest_complete(tag_dir.parent)
    resume = (f"The last good checkpoint is {latest}: `run.resume: auto` continues from it (the incomplete "
              f"{tag_dir.name} is discarded then)" if latest else
              "No checkpoint is complete yet: the same command starts over")
    return SaveFailed(f"cannot write the checkpoint {tag_dir}: {cause}. {_free_space(tag_dir)} free on the "
                      f"filesystem of {tag_dir.parent} now. {resume}. Free space there (run.keep_last keeps fewer "
                      "checkpoints) or give another run.output_dir, then run the same command")


def _free_space(path: Path) -> str:
    """Free space on the filesystem of ``path`` (or of its nearest existing parent), for people."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = float(shutil.disk_usage(path).free)
    except OSError:
        return "unknown space"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024:
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    return f"{free:.1f} TiB"


class DamagedCheckpoint(CheckpointError):
    """A file of a complete checkpoint is missing or unreadable (truncated, not a torch file, bad JSON).

    ``run.resume: auto`` falls back to the previous complete checkpoint; a checkpoint
    named explicitly stops the run.
    """


def tag_for(global_step: int) -> str:
    return f"step_{global_step}"


def is_complete(tag_dir: Path) -> bool:
    return (Path(tag_dir) / COMPLETE_MARKER).is_file()


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete checkpoints under ``ckpt_dir``, newest first."""
    if not Path(ckpt_dir).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).iterdir()
             if (m := _TAG.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found, reverse=True)]


def latest_complete(ckpt_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``ckpt_dir``, if any."""
    found = complete_checkpoints(ckpt_dir)
    return found[0] if found else None


def read_marker(tag_dir: Path) -> dict:
    """What ``mark_complete`` recorded about a checkpoint (step, epoch, world size, global batch...)."""
    path = Path(tag_dir) / COMPLETE_MARKER
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DamagedCheckpoint(f"{path}: unreadable completion marker ({type(e).__name__}: {e})") from None
    if not isinstance(info, dict) or not isinstance(info.get("global_step"), int):
        raise DamagedCheckpoint(f"{path}: not a lavis_ds completion marker (expected a JSON object with "
                                f"global_step, epoch, world_size, global_batch; got {str(info)[:80]!r})")
    return info


def writer_of(tag_dir: Path) -> str:
    """The engine a checkpoint's completion marker names (a marker older than that field: the engine whose
    files the folder holds); DamagedCheckpoint if the marker is unreadable or names none."""
    marker = read_marker(tag_dir)
    if "runner" in marker:
        return marker["runner"]
    writers = _writers_by_files(Path(tag_dir))
    if not writers:
        raise DamagedCheckpoint(f"{tag_dir}: its completion marker names no engine and the folder holds no "
                                f"registered engine's checkpoint files")
    return writers[0]


def _writers_by_files(folder: Path) -> list[str]:
    """The registered engines whose checkpoint files (``Engine.checkpoints.FILES``) ``folder`` holds, the
    most basic class first (a user's subclass writes its parent's files)."""
    found = [(name, cls) for name, cls in engine_registry.distinct().items()
             if any(any(folder.glob(pattern)) for pattern in cls.checkpoints.FILES)]
    return [name for name, cls in sorted(found, key=lambda found: len(found[1].__mro__))]


def load_file(path: Path, mmap: bool = False, allowed: Iterable = ()) -> dict:
    """One checkpoint file, read without running code (``safe_files.torch_load``: tensors, plain containers, numpy's
    RNG classes and ``allowed``, the engine's own classes); a missing, truncated or foreign file is a
    DamagedCheckpoint naming it, a file asking for any other class an UnsafeFile.

    ``mmap=True`` reads only the file's index and pickle, not its tensors: a cheap check that it is whole and safe.
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedCheckpoint(f"{path}: file missing")
    try:
        return safe_files.torch_load(path, allowed, mmap=mmap, map_location="cpu")
    except safe_files.UnsafeFile:
        raise
    except Exception as e:  # torch reports a truncated zip as "PytorchStreamReader failed ..." without the path
        # torch's first sentence says what failed; the rest is generic advice
        reason = str(e).splitlines()[0].split(". ")[0] if str(e) else type(e).__name__
        raise DamagedCheckpoint(f"{path}: unreadable ({reason}); the file is truncated or not a torch "
                                f"checkpoint file") from None


def saved_config(tag_dir: Path, client_state: dict):
    """The run config (DictConfig) an engine saved in its client state (its ``lavis_ds`` key)."""
    from omegaconf import OmegaConf

    client = client_state.get("lavis_ds")
    if not isinstance(client, dict) or "config" not in client:
        raise CheckpointError(f"{tag_dir} holds no lavis_ds client state (key 'lavis_ds' with the run config): "
                              "it was not written by a lavis_ds engine")
    return OmegaConf.create(client["config"])


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
    delete_folders(doomed, ckpt_dir)
    return doomed


def discard_incomplete(ckpt_dir: Path) -> list[Path]:
    """Delete the folders of saves that never completed (a resume starts before them)."""
    if not Path(ckpt_dir).is_dir():
        return []
    torn = [p for p in Path(ckpt_dir).iterdir() if _TAG.match(p.name) and not is_complete(p)]
    delete_folders(torn, ckpt_dir)
    return torn


def delete_folders(folders: list[Path], ckpt_dir: Path) -> None:
    for path in folders:
        trash = path.with_name(f".deleting-{path.name}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    for trash in Path(ckpt_dir).glob(".deleting-*"):  # a deletion that a kill interrupted
        shutil.rmtree(trash, ignore_errors=True)


def set_aside(tag_dir: Path) -> Path:
    """Rename a damaged checkpoint to ``step_<N>.damaged`` (kept for inspection; never resumed, pruned or
    overwritten when training reaches step N again). Returns the new path."""
    tag_dir = Path(tag_dir)
    target, n = tag_dir.with_name(tag_dir.name + DAMAGED_SUFFIX), 1
    while target.exists():
        n += 1
        target = tag_dir.with_name(f"{tag_dir.name}{DAMAGED_SUFFIX}{n}")
    os.replace(tag_dir, target)
    return target


def looks_like_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a registered engine's checkpoint files, complete or not."""
    return bool(_writers_by_files(Path(folder)))


def trainable_problems(tag_dir: Path, saved: dict[str, tuple], model: torch.nn.Module) -> list[str]:
    """How the model's trainable parameters differ from those saved in ``tag_dir`` (``saved``: their names and
    shapes; empty result: they match).

    The engine loads lean checkpoints non-strictly (frozen weights are absent on purpose),
    which would leave a parameter that became trainable at its initial value, and
    DeepSpeed refuses a parameter set that shrank with "parameter-alignment layout does
    not match". Both are changes of freeze_* / get_lora / lr settings between runs.
    """
    every_name = dict(model.named_parameters(remove_duplicate=False))  # tied aliases are names too
    renames = getattr(model, "RENAMED_KEYS", ())
    old_names = [name for name in saved if name not in every_name and renamed(name, renames) in every_name]
    if old_names:
        return [(f"its parameters have the names {type(model).__name__} gave them before ({_names(old_names)}); the "
                 "optimizer state follows the parameters' order, which changed with them, so it cannot be resumed. "
                 "Its weights load under today's names: export it (lavis-ds export) and start a run from the export "
                 "(model.load_pretrained: true, model.pretrained: the export folder), or pass run.resume=false")]
    trainable = {name: dist.full_shape(p) for name, p in model.named_parameters() if p.requires_grad}
    trainable_aliases = {name for name, p in every_name.items() if p.requires_grad}
    problems = []
    new = [name for name in trainable if name not in saved]
    if new:
        problems.append(f"{len(new)} parameter(s) train now but were not trained in the checkpoint: {_names(new)}")
    frozen_now = [name for name in saved if name in every_name and name not in trainable_aliases]
    if frozen_now:
        problems.append(f"{len(frozen_now)} parameter(s) trained in the checkpoint are frozen now: "
                        f"{_names(frozen_now)}")
    unknown = [name for name in saved if name not in every_name]
    if unknown:
        problems.append(f"{len(unknown)} saved parameter(s) are not in this model: {_names(unknown)}")
    shapes = [f"{name} {saved[name]} saved vs {shape} now" for name, shape in trainable.items()
              if name in saved and saved[name] != shape]
    if shapes:
        problems.append(f"{len(shapes)} parameter(s) changed shape: {_names(shapes)}")
    if problems:
        problems.append("the model was built with other settings than the run that saved it (freeze_*, get_lora, "
                        "sizes): restore them to resume, or pass run.resume=false (or a new run.output_dir) to "
                        "start over")
    return problems


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


