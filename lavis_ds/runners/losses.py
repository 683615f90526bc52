"""A step's losses as the loop handles them: the weights that normalise a micro-batch's summed loss terms (per unit
of the objective: tokens, pairs), and the check of the step's losses on every rank before the update is applied."""
from __future__ import annotations

import math

import torch

from lavis_ds.common import comm
from lavis_ds.common.errors import report
from lavis_ds.objectives import Objective, micro_batch_weights
from lavis_ds.objectives.base import metric_means
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners import faults
from lavis_ds.runners.data import image_name


def unit_counts(objective: Objective, model: torch.nn.Module, micro_batches: list[dict]) -> list[int]:
    """This rank's count of each of the objective's units (``UNITS`` order) in a step's prepared micro-batches."""
    counts = [objective.counts(model, batch) for batch in micro_batches]
    return [sum(int(c.get(unit, 0)) for c in counts) for unit in objective.UNITS]


def step_loss_weights(global_counts: dict[str, int] | None, accum: int, world_size: int) -> dict[str, float] | None:
    """What each micro-batch's summed loss term of each unit is multiplied by (``engine.micro_batch_loss``), from
    the units of the whole step over every rank (None: the per-micro-batch mean instead).

    Every engine averages its micro-batch losses over micro-batches and ranks, so a micro-batch's term is
    ``sum * accum * world_size / count``: their mean is the step's summed term over its count, the same number
    and gradient however the global batch is split (``objectives.micro_batch_weights``)."""
    return None if global_counts is None else micro_batch_weights(global_counts, accum, world_size)


def check_losses(trainer, losses: torch.Tensor, metric_sums: dict | None = None,
                 global_counts: dict[str, int] | None = None, ahead: list[int] | None = None
                 ) -> tuple[dict, list[int] | None]:
    """``LossCheck`` started and finished at once, for a caller that has the step's losses only after its backward."""
    return LossCheck(losses, metric_sums, ahead).finish(trainer, global_counts)


class LossCheck:
    """A step's mean loss over every rank and micro-batch, and the objective's metrics (``metric_sums`` summed over
    every rank in the same all-reduce, divided by the step's ``global_counts`` of their units); a NaN/inf loss is
    named and handled here. ``ahead``: integers summed in the same all-reduce, returned as totals (the next step's
    agreement, ``faults.step_flags``; None: none).

    One all-reduce tells every rank whether any loss was non-finite, before any rank applies the update:
    `run.on_nonfinite: stop` raises on all of them (the weights and checkpoints never see the diverged step),
    `skip` drops the update on all of them. It is started as soon as the losses are known, before the step's last
    backward (``Engine.forward_backward`` returns to the loop before it: ``Trainer.run_step``), and finished after
    it, so the backward hides its latency.
    """

    def __init__(self, losses: torch.Tensor, metric_sums: dict | None = None, ahead: list[int] | None = None):
        # ``losses`` stayed on the engine's device until here: this copy to the host is the step's only
        # synchronisation after the forward that the loop itself makes.
        self.losses, self.metric_sums = losses, metric_sums or {}
        # The summed loss is finite only if every rank's every loss is (an inf or a NaN stays one in a sum of
        # float64s far below their overflow): it is the check, with no count of its own.
        values = [losses.sum(), *(value.to(losses) for _, value in self.metric_sums.values())]
        self._split, self._ahead = len(values), ahead is not None
        # float64 sums of integers are exact below 2**53; the flags are born on the host and stay there
        self._collect = comm.start_all_reduce(torch.cat([torch.stack(values).to("cpu", torch.float64),
                                                         torch.tensor(ahead or [], dtype=torch.float64)]))

    def finish(self, trainer, global_counts: dict[str, int] | None = None) -> tuple[dict, list[int] | None]:
        """The step's metrics (``loss`` None and ``skipped`` if it is dropped) and the totals of ``ahead``."""
        totals = self._collect().tolist()
        totals, ahead_totals = totals[:self._split], [int(t) for t in totals[self._split:]] if self._ahead else None
        if math.isfinite(totals[0]):
            return {"loss": totals[0] / (len(self.losses) * trainer.world_size),
                    **metric_means(self.metric_sums, totals[1:], global_counts or {})}, ahead_totals
        where = describe_nonfinite(trainer, self.losses)
        if trainer.run.on_nonfinite == "stop":
            latest = ckpt.latest_complete(trainer.checkpoint_dir)
            error = faults.NonFiniteLoss(
                f"{where}. run.on_nonfinite=stop: stopped before this optimizer step, so no weight and no checkpoint "
                f"holds a diverged value; `run.resume: auto` continues from "
                f"{latest or 'the start (no checkpoint yet)'}. Set run.on_nonfinite=skip to drop such steps and go on")
            error.quiet = trainer.rank != 0  # every rank raises it; one prints it
            raise error
        if trainer.rank == 0:
            report(f"{where}. run.on_nonfinite=skip: this optimizer step is skipped (no parameter update)")
        return {"loss": None, "skipped": "nonfinite_loss"}, ahead_totals


def describe_nonfinite(trainer, losses: torch.Tensor) -> str:
    """Step, rank, micro-batch and samples of every non-finite loss (collective: gathers from all ranks)."""
    state, data = trainer.state, trainer.data
    indices = data.sampler.step_indices(state.step_in_epoch)
    mine = [(m, float(loss), indices[m]) for m, loss in enumerate(losses.tolist()) if not math.isfinite(loss)]
    parts = []
    for rank, bad in enumerate(comm.all_gather_object(mine)):
        for m, value, samples in bad:
            names = [name for i in samples[:4] if (name := image_name(data.train_set.dataset, i))]
            parts.append(f"rank {rank}, micro-batch {m + 1} of {data.accum}: {value} (training samples "
                         f"{', '.join(map(str, samples))}" + (f"; images {', '.join(names)}" if names else "") + ")")
    return (f"non-finite loss at optimizer step {state.global_step + 1} (epoch {state.epoch}): " + "; ".join(parts))
