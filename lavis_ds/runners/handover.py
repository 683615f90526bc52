"""Switching engines, the shared part: whose a checkpoint is, whether this run can continue it, and saying so.

A checkpoint written by another engine continues here when both keep AdamW's state per parameter in fp32: the
writer's checkpoints part reads it out (``Engine.checkpoints``: ``handover_shapes``, ``read_handover``), this
engine says whether it can take it exactly (``Engine.takeover_problem``) and loads it in its ``load_checkpoint``.
The resume plan names the writer when it is another engine (``resume.ResumePlan.handover_from``, from
``foreign_writer``); an engine's ``check_checkpoint`` calls ``check_takeover`` for such a checkpoint, and its load
``report_takeover``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lavis_ds.common import registry as reg
from lavis_ds.common.registry import engines as engine_registry
from lavis_ds.runners import checkpoint as ckpt

if TYPE_CHECKING:
    from lavis_ds.runners.engine import Engine


def engine_name(engine: Engine) -> str:
    """The registered name of ``engine``'s class (``run.runner`` without its alias)."""
    return engine_registry.canonical(engine.run.runner)


def foreign_writer(engine: Engine, tag_dir: Path) -> type[Engine] | None:
    """The engine class that wrote ``tag_dir`` if it is another engine's (None: ``engine``'s own kind)."""
    writer = ckpt.writer_of(tag_dir)  # whole, or DamagedCheckpoint
    if writer not in engine_registry:
        raise ckpt.CheckpointError(f"{tag_dir} was written by {writer}, which is not a registered engine here "
                                   f"(known: {', '.join(engine_registry)}); list its module under `imports:`")
    source = reg.engines.get(writer)
    return None if isinstance(engine, source) else source


def check_takeover(engine: Engine, tag_dir: Path, source: type[Engine]) -> None:
    """A CheckpointError unless ``tag_dir``, written by ``source``, continues under ``engine`` exactly: the writer's
    side (its engine layout), this run's side, and the trained parameters."""
    writer = ckpt.writer_of(tag_dir)
    problem = engine.takeover_problem()
    if problem:
        raise ckpt.CheckpointError(
            f"{tag_dir} was written by {writer}, and {engine_name(engine)} {problem}. Resume with run.runner: "
            f"{writer}, or start afresh (--options run.resume=false, or another run.output_dir)")
    saved = source.checkpoints.handover_shapes(tag_dir, engine.rank)
    problems = ckpt.trainable_problems(tag_dir, saved, engine.model)
    if problems:
        raise ckpt.CheckpointError(f"{tag_dir} does not fit this model: " + "; ".join(problems))


def report_takeover(engine: Engine, tag_dir: Path) -> None:
    if engine.rank == 0:
        print(f"resumed {ckpt.writer_of(tag_dir)}'s checkpoint {tag_dir} under {engine_name(engine)} (fp32 weights "
              f"and AdamW moments carried over parameter by parameter)", flush=True)
