"""Switching engines, the shared part: whose a checkpoint is, whether this run can continue it, and saying so.

A checkpoint written by another runner continues here when both engines keep AdamW's state per parameter
in fp32: the writer reads it out (``Engine.handover_shapes``, ``Engine.read_handover``), this runner says
whether it can take it exactly (``Engine.takeover_problem``) and loads it in its ``load_checkpoint``. An
engine's ``check_checkpoint`` and ``load_checkpoint`` call ``foreign_writer`` first, then ``check_takeover``
or its own takeover, and ``report_takeover`` once loaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lavis_ds.common.registry import registry
from lavis_ds.common.registry import runners as runner_registry
from lavis_ds.runners import checkpoint as ckpt

if TYPE_CHECKING:
    from lavis_ds.runners.base import RunnerBase


class EngineSwitch:
    """Mixed into ``RunnerBase``; uses its ``run``, ``rank`` and ``model`` and the engine's ``takeover_problem``."""

    @property
    def name(self) -> str:
        """The registered name of this runner (``run.runner`` without its alias)."""
        return runner_registry.canonical(self.run.runner)

    def foreign_writer(self, tag_dir: Path) -> type[RunnerBase] | None:
        """The runner class that wrote ``tag_dir`` if it is another engine's (None: this runner's own)."""
        writer = ckpt.writer_of(tag_dir)  # whole, or DamagedCheckpoint
        if writer not in runner_registry:
            raise ckpt.CheckpointError(f"{tag_dir} was written by {writer}, which is not a registered runner here "
                                       f"(known: {', '.join(runner_registry)}); list its module under `imports:`")
        source = registry.get_runner_class(writer)
        return None if isinstance(self, source) else source

    def check_takeover(self, tag_dir: Path, source: type[RunnerBase]) -> None:
        """A CheckpointError unless ``tag_dir``, written by ``source``, continues here exactly: the writer's
        side (its engine layout), this run's side, and the trained parameters."""
        writer = ckpt.writer_of(tag_dir)
        problem = self.takeover_problem()
        if problem:
            raise ckpt.CheckpointError(
                f"{tag_dir} was written by {writer}, and {self.name} {problem}. Resume with run.runner: {writer}, "
                f"or start afresh (--options run.resume=false, or another run.output_dir)")
        saved = source.handover_shapes(tag_dir, self.rank)
        problems = ckpt.trainable_problems(tag_dir, saved, self.model)
        if problems:
            raise ckpt.CheckpointError(f"{tag_dir} does not fit this model: " + "; ".join(problems))

    def report_takeover(self, tag_dir: Path) -> None:
        if self.rank == 0:
            print(f"resumed {ckpt.writer_of(tag_dir)}'s checkpoint {tag_dir} under {self.name} (fp32 weights and "
                  f"AdamW moments carried over parameter by parameter)", flush=True)
