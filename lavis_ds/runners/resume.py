"""Resumption: which checkpoint a run continues and the batch layout that follows from it (a ``ResumePlan``,
settled before the engine is wrapped), and restoring it once the engine is.

``run.resume`` (``auto``, a checkpoint or run folder, or false; ``lavis_compat`` translates MiniGPT4Qwen's
``resume_ckpt_load_dir`` / ``resume_ckpt_tag`` into it) names the candidates; every rank checks the files it
will read (the engine's ``check_checkpoint``) and all agree. With ``auto`` a damaged checkpoint is set aside
(renamed, never deleted) and the previous complete one is taken. A checkpoint saved by another number of
processes keeps its global batch (the accumulation changes: an elastic resume).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from lavis_ds.common import comm
from lavis_ds.common.errors import ConfigError, report
from lavis_ds.common.run_config import batch_sizes, elastic_batch_sizes
from lavis_ds.common.seeding import seed_everything
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.handover import foreign_writer
from lavis_ds.runners.resume_plan import ResumePlan

if TYPE_CHECKING:
    from lavis_ds.runners.engine import Engine


@dataclass
class TrainState:
    """Where training is. Saved in every checkpoint; enough to continue exactly there."""

    epoch: int = 0
    global_step: int = 0  # optimizer steps done
    step_in_epoch: int = 0  # optimizer steps done in `epoch`


def plan_resume(engine: Engine, run, checkpoint_dir: Path) -> ResumePlan:
    """The checkpoint to continue (collective: every rank checks it) and the batch layout that follows from it."""
    source = resume_source(engine, run, checkpoint_dir)
    micro, accum, total = batch_sizes(OmegaConf.to_container(run), engine.world_size)
    saved = _saved_layout(source)
    elastic = saved is not None and saved["world_size"] != engine.world_size
    if elastic:
        where = f"resuming {source[0] / source[1]} (saved by {saved['world_size']} processes)"
        try:
            micro, accum, total = elastic_batch_sizes(micro, saved["global_batch"], engine.world_size, where)
        except ValueError as e:
            raise ConfigError([str(e)], str(source[0])) from None
    writer = foreign_writer(engine, source[0] / source[1]) if source is not None else None
    return ResumePlan(source, micro, accum, total, elastic, writer)


def resume_source(engine: Engine, run, checkpoint_dir: Path) -> tuple[Path, str] | None:
    """(load_dir, tag) to resume from, following run.resume.

    Every rank checks the files it will read, and all agree on the result: with
    `run.resume: auto`, a damaged checkpoint is set aside (renamed, never deleted) and
    the previous complete one is taken; a checkpoint named explicitly must be whole.
    """
    candidates, explicit, what = _resume_candidates(run.resume, checkpoint_dir)
    for tag_dir in candidates:
        problem = None
        try:
            engine.check_checkpoint(tag_dir, same_world=_saved_world(tag_dir) == engine.world_size)
        except ckpt.CheckpointError as e:
            problem = (str(e), isinstance(e, ckpt.DamagedCheckpoint))
        problems = [p for p in comm.all_gather_object(problem) if p is not None]
        if not problems:
            return tag_dir.parent, tag_dir.name
        message, damaged = problems[0]
        if not damaged or explicit:
            error = (ckpt.DamagedCheckpoint if damaged else ckpt.CheckpointError)(
                f"{what}: {message}" + ("; name another checkpoint, or pass run.resume=auto to take the newest "
                                        "readable one" if damaged else ""))
            error.quiet = engine.rank != 0  # every rank knows the same problem; one prints it
            raise error
        if engine.rank == 0:
            kept = ckpt.set_aside(tag_dir)
            report(f"{message}; the checkpoint is set aside as {kept} (not deleted) and the previous complete "
                   "checkpoint is used instead")
        comm.barrier()
    if explicit or candidates:
        error = ckpt.CheckpointError(f"{what}: no readable complete checkpoint (the damaged ones were set aside); "
                                     "pass run.resume=false or a new run.output_dir to start over")
        error.quiet = engine.rank != 0
        raise error
    return None


def _resume_candidates(resume, checkpoint_dir: Path) -> tuple[list[Path], bool, str]:
    """(complete checkpoints to try in order, whether the user named exactly one, the setting that named them)."""
    if resume in (False, None):
        return [], False, "run.resume"
    if resume == "auto":
        return ckpt.complete_checkpoints(checkpoint_dir), False, "run.resume=auto"
    path, what = Path(resume), f"run.resume={resume}"
    if ckpt.is_complete(path):
        return [path], True, what
    found = ckpt.complete_checkpoints(path)
    if not found:
        _complete_or_error(path, what)
    return found, False, what


def _complete_or_error(path: Path, what: str) -> Path:
    if ckpt.is_complete(path):
        return path
    newest = ckpt.latest_complete(path.parent) if path.parent.is_dir() else None
    if not path.exists():
        state = "does not exist"
    elif ckpt.looks_like_checkpoint(path):
        state = f"is an incomplete checkpoint (no {ckpt.COMPLETE_MARKER}: a save that did not finish)"
    else:
        state = "is not a checkpoint folder"
    raise ckpt.CheckpointError(
        f"{what}: {path} {state}; it holds no complete lavis_ds checkpoint (a step_<N> folder with "
        f"{ckpt.COMPLETE_MARKER}); " + (f"the newest complete one beside it is {newest}" if newest else
                                        "name a complete checkpoint, or use run.resume=auto"))


def _saved_world(tag_dir: Path) -> int | None:
    try:
        return ckpt.read_marker(tag_dir).get("world_size")
    except ckpt.DamagedCheckpoint:
        return None  # check_checkpoint reports it


def _saved_layout(source: tuple[Path, str] | None) -> dict | None:
    """World size and global batch of the checkpoint to resume from (None: fresh start or unknown)."""
    if source is None:
        return None
    info = ckpt.read_marker(source[0] / source[1])
    return info if "world_size" in info else None


def restore(engine: Engine, plan: ResumePlan, scheduler, run, checkpoint_dir: Path) -> TrainState:
    """Load the planned checkpoint into the wrapped engine and the LR schedule, and its random states where the
    world size is the one that saved them; the loop's state to continue from (a fresh one, seeded, if none)."""
    rank = engine.rank
    if plan.source is None:
        seed_everything(run.seed + rank)
        return TrainState()
    load_dir, tag = plan.source
    if rank == 0:
        # A save the kill interrupted: its steps come again, and its folder must not hold stale files.
        for torn in ckpt.discard_incomplete(checkpoint_dir):
            print(f"discarded the incomplete checkpoint {torn}", flush=True)
    comm.barrier()
    client = engine.load_checkpoint(load_dir, tag)["lavis_ds"]
    state = TrainState(**client["train_state"])
    scheduler.load_state_dict(client["scheduler"])
    rng = ckpt.rng_file(load_dir / tag, rank)
    if client.get("world_size") == engine.world_size and rng.is_file():
        ckpt.restore_rng_states(ckpt.load_file(rng))
    else:
        seed_everything(run.seed + rank + state.global_step)
    if rank == 0:
        print(f"resumed from {load_dir / tag} at epoch {state.epoch}, step {state.global_step} "
              f"({state.step_in_epoch} into the epoch), lr {scheduler.get_lr():.3e}", flush=True)
    return state
