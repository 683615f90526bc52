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

from lavis_ds.common import dist
from lavis_ds.common.errors import InputError

COMPLETE_MARKER = "lavis_ds_complete.json"
DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint is renamed out of the step_<N> namespace, never deleted
_TAG = re.compile(r"^step_(\d+)$")


class CheckpointError(InputError):
    """A checkpoint that cannot be resumed from or exported; the message names the folder or file."""


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


def written_by(info: dict) -> str:
    """The runner a completion marker names (markers older than the field were written by runner_deepspeed)."""
    return info.get("runner", "runner_deepspeed")


def load_file(path: Path, mmap: bool = False) -> dict:
    """``torch.load`` of one checkpoint file; a missing, truncated or foreign file is a DamagedCheckpoint naming it.

    ``mmap=True`` reads only the file's index and pickle, not its tensors: a cheap check that it is whole.
    weights_only=False: DeepSpeed pickles its own objects into checkpoints (its loader does the same).
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedCheckpoint(f"{path}: file missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # torch reports a truncated zip as "PytorchStreamReader failed ..." without the path
        # torch's first sentence says what failed; the rest is generic advice
        reason = str(e).splitlines()[0].split(". ")[0] if str(e) else type(e).__name__
        raise DamagedCheckpoint(f"{path}: unreadable ({reason}); the file is truncated or not a torch "
                                f"checkpoint file") from None


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
    scored = [(loss, p) for p in complete_checkpoints(ckpt_dir) if (loss := _val_loss(p)) is not None]
    return min(scored)[1] if scored else None


def _val_loss(tag_dir: Path) -> float | None:
    try:
        return read_marker(tag_dir).get("val_loss")
    except DamagedCheckpoint:
        return None  # a damaged marker competes for nothing (resume reports it)


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
    """Whether ``folder`` holds an engine's checkpoint files (DeepSpeed's model states or a DCP index),
    complete or not."""
    return any(Path(folder).glob("*model_states.pt")) or (Path(folder) / ".metadata").is_file()


def model_states_file(tag_dir: Path) -> Path:
    """The DeepSpeed file holding the module state dict (ZeRO-3 names it per data-parallel rank)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (Path(tag_dir) / name).is_file():
            return Path(tag_dir) / name
    raise DamagedCheckpoint(f"{tag_dir}: no DeepSpeed model states file (mp_rank_00_model_states.pt); "
                            "is this a DeepSpeed checkpoint folder?")


def files_of_rank(tag_dir: Path, rank: int, same_world: bool) -> list[Path]:
    """The files ``rank`` reads to resume from ``tag_dir``.

    Every rank reads the model states; each its own optimizer partition and RNG
    states, unless the world size changed: then rank 0 converts every partition.
    """
    tag_dir = Path(tag_dir)
    files = sorted(tag_dir.glob("*model_states.pt")) or [model_states_file(tag_dir)]
    optim = sorted(tag_dir.glob("*optim_states.pt"))
    if same_world:
        optim = [f for f in optim if f"zero_pp_rank_{rank}_" in f.name]
        return files + optim + [rng_file(tag_dir, rank)]
    return files + (optim if rank == 0 else [])


def check_files(files: list[Path], zero_stage: int) -> None:
    """Raise DamagedCheckpoint naming the first of ``files`` that is missing or does not load."""
    for path in files:
        load_file(path, mmap=True)
    if zero_stage > 0 and not any(f.name.endswith("optim_states.pt") for f in files if f.is_file()):
        folder = files[0].parent
        raise DamagedCheckpoint(f"{folder}: the optimizer states of this rank (*zero_pp_rank_*_optim_states.pt) "
                                f"are missing; ZeRO-{zero_stage} keeps them in one file per rank")


def saved_trainable(states: dict) -> dict[str, tuple]:
    """Names and shapes of the parameters that trained when the checkpoint was saved."""
    if states.get("param_shapes"):  # ZeRO 1-3: the optimizer's parameters
        return {name: tuple(shape) for group in states["param_shapes"] for name, shape in group.items()}
    buffers = set(states.get("buffer_names") or ())  # ZeRO-0: the module was saved without frozen parameters
    return {name: tuple(t.shape) for name, t in (states.get("module") or {}).items() if name not in buffers}


def trainable_problems(tag_dir: Path, saved: dict[str, tuple], model: torch.nn.Module) -> list[str]:
    """How the model's trainable parameters differ from those saved in ``tag_dir`` (``saved``: their names and
    shapes; empty result: they match).

    The engine loads lean checkpoints non-strictly (frozen weights are absent on purpose),
    which would leave a parameter that became trainable at its initial value, and
    DeepSpeed refuses a parameter set that shrank with "parameter-alignment layout does
    not match". Both are changes of freeze_* / get_lora / lr settings between runs.
    """
    every_name = dict(model.named_parameters(remove_duplicate=False))  # tied aliases are names too
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
