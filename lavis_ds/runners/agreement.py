"""Every rank's agreement to take an optimizer step: a part of the ``Trainer``.

Before a step's forward every rank must know that all of them take it (no stop signal, no failure anywhere:
``faults``) and the step's global count of each of the objective's units, which weights its loss terms
(``losses.step_loss_weights``). Within an epoch that agreement is made during the previous step, in the
all-reduce of its loss check, so a step makes one collective, not two; an epoch's first step agrees alone.
"""
from __future__ import annotations

import signal

from lavis_ds.common.errors import LavisDsError
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners import faults
from lavis_ds.runners.losses import step_loss_weights, unit_counts

Agreed = tuple[dict[str, float] | None, dict[str, int] | None]  # a step's loss weights and global unit counts
Brought = tuple[LavisDsError | None, list[int] | None]  # a rank's failure and unit counts, beside its signals


class StepAgreement:
    """The stop signals this process receives, and the agreement on the next step made during this one."""

    def __init__(self):
        self.signals = faults.SignalCatcher()  # listens while the loop runs
        self._ahead: tuple[list[dict], Agreed] | None = None  # the next step's micro-batches, agreed during this
        self._pending: tuple[list[dict], Brought] | None = None  # the next step's, between ``ahead`` and ``settle``

    def for_step(self, trainer, micro_batches: list[dict]) -> Agreed:
        """The agreed loss weights and unit counts of the step on ``micro_batches``: made during the previous step
        if that one loaded them (``ahead``), else now, in an all-reduce of its own. Raises on every rank instead
        if any rank received a stop signal or failed (collective)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is micro_batches:
            return ahead[1]
        return self._act(trainer, *faults.agree_on_step(self.signals.received, *_brought(trainer, micro_batches)))

    def ahead(self, trainer, following: list[dict]) -> list[int]:
        """This rank's flags of the next step's agreement (``faults.step_flags``), to sum in this step's loss
        check; ``settle`` reads their totals."""
        brought = _brought(trainer, following)
        self._pending = following, brought
        return faults.step_flags(self.signals.received, *brought)

    def settle(self, trainer, totals: list[int]) -> None:
        """Act on the next step's agreement once this step is done (collective): stop every rank here, or keep its
        weights and counts for ``for_step``."""
        (following, brought), self._pending = self._pending, None
        self._ahead = following, self._act(trainer, *faults.read_step_flags(totals, *brought))

    @staticmethod
    def _act(trainer, signum: int, step_counts: list[int] | None) -> Agreed:
        if signum:
            trainer.call_hooks("on_stop", signum)  # the Checkpointer asks for a save on SIGTERM
            stopped = faults.Stopped(signum, _stop_message(trainer, signum))
            stopped.quiet = trainer.rank != 0  # every rank stops here; one says so
            raise stopped
        counts = None if step_counts is None else dict(zip(trainer.data.objective.UNITS, step_counts, strict=True))
        return step_loss_weights(counts, trainer.data.accum, trainer.world_size), counts


def _brought(trainer, micro_batches: list[dict]) -> Brought:
    """This rank's part of a step's agreement beside its signals: its failure (a sample that failed to load, a
    hook's) and the step's units in its micro-batches (supervised tokens, pairs; None: not counted)."""
    objective, model = trainer.data.objective, trainer.engine.model
    mine = unit_counts(objective, model, micro_batches) if objective.counted(trainer.run, model) else None
    return trainer.data.take_failure() or trainer.hooks.take_failure(), mine


def _stop_message(trainer, signum: int) -> str:
    latest = ckpt.latest_complete(trainer.checkpoint_dir)
    step, name = trainer.state.global_step, signal.Signals(signum).name
    if trainer.saved_step == step and latest is not None and signum == signal.SIGTERM:
        return (f"stopped by {name} after optimizer step {step}: saved {latest}; "
                f"run the same command to continue from there")
    return (f"stopped by {name} after optimizer step {step} without saving; the same command continues from "
            f"{latest or 'the start (no checkpoint yet)'}")
