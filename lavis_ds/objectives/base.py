"""What a training objective is: a registered part that asks the model for what it needs and turns it into a loss.

An objective's loss is a sum of terms, each a sum over some unit - ``tokens`` (next-token cross-entropy, SFT)
or ``pairs`` (a preference loss) - divided by how many of that unit the whole global batch holds (every
micro-batch, every process). So an optimizer step's loss and gradient do not depend on how the global batch
is split into micro-batches, accumulation steps and processes (the rule transformers adopted for tokens in
4.46, applied per unit). The trainer's part (``global_loss``): count each unit on the host before the step
(``prepare`` + ``counts``), all-reduce the counts once, and weight each micro-batch's summed terms.

Metrics are sums too, each over one unit (``pairs`` for the rewards), and are divided like the loss.

Configuration: ``run.task`` names the objective (LAVIS's key; its task names mean SFT) and the run section
named after the objective holds its options, e.g. ``run.task: dpo`` with ``run.dpo: {beta: 0.1}``. The options
are the constructor's keyword arguments, checked by ``lavis_ds.common.schema`` like every other section.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

TOKENS = "tokens"  # supervised answer tokens
PAIRS = "pairs"  # preference pairs


@dataclass
class ObjectiveOutput:
    """One micro-batch's loss terms and metrics, each a sum over a unit.

    Attributes:
        loss_sums: ``{unit: summed loss}`` (differentiable); the step's loss is the sum over units of
            ``loss_sums[unit]`` summed over micro-batches and processes, divided by the global count of the unit.
        metric_sums: ``{name: (unit, summed value)}``, detached; reported divided by the unit's global count.
    """

    loss_sums: dict[str, Tensor]
    metric_sums: dict[str, tuple[str, Tensor]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain nested dicts, as a model's forward returns them (FSDP2 and ZeRO-3 find the tensors of a forward's
        output through dicts, tuples and lists, not through a dataclass)."""
        return {"loss_sums": dict(self.loss_sums), "metric_sums": dict(self.metric_sums)}


class Objective:
    """Base of every objective. A subclass sets ``UNITS`` and implements ``counts`` and ``__call__``.

    Constructors take the options of the objective's run section as plain keyword arguments (so a test builds
    one without YAML); ``from_config`` maps the section to them.
    """

    UNITS: ClassVar[tuple[str, ...]] = (TOKENS,)
    # The data an objective trains on: "sequences" (instruction/output samples) or "pairs" (preference pairs).
    DATA: ClassVar[str] = "sequences"

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None = None) -> Objective:
        return cls(**dict(section or {}))

    def prepare(self, model: torch.nn.Module, batch: dict[str, Any], pack_to: int | None = None) -> dict[str, Any]:
        """The micro-batch as the host prepares it before the step (tokenized), so ``counts`` needs no device.

        A batch the objective scores itself names it under ``"objective"``: the model's ``forward`` then calls
        the objective (inside the root module's forward, where sharded engines have gathered its parameters).
        ``pack_to``: ``run.packing``'s row length, for objectives that pack."""
        return batch

    def setup(self, model: torch.nn.Module) -> None:
        """Once, with the starting weights, before an engine wraps the model. Default: nothing."""

    def before_train(self, trainer: Any, resuming: bool) -> None:
        """Once, after the engine wrapped the model and before a checkpoint is restored into it (the weights are
        still the starting ones; ``resuming``: a checkpoint will be). Collective. Default: nothing."""

    def counted(self, run: Any, model: torch.nn.Module) -> bool:
        """Whether the loop weights each micro-batch's loss sums by the global batch's unit counts (``counts``);
        otherwise each micro-batch's own mean is averaged (``run.loss_reduction: mean``). Default: always."""
        return True

    def counts(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, int]:
        """``{unit: how many this prepared micro-batch holds}``, for every unit of ``UNITS`` in use."""
        raise NotImplementedError

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> ObjectiveOutput:
        raise NotImplementedError

    def record(self, output: ObjectiveOutput) -> ObjectiveOutput:
        """Keep ``output``'s metric sums for ``take_metric_sums`` (the engines return only the loss)."""
        # set here, not in a constructor: a user's objective need not call ours
        vars(self).setdefault("pending", []).append(output.metric_sums)
        return output

    def take_metric_sums(self) -> dict[str, tuple[str, Tensor]]:
        """The metric sums of every call since the last take, summed per name (on the device: no host sync)."""
        totals: dict[str, tuple[str, Tensor]] = {}
        for sums in getattr(self, "pending", []):
            for name, (unit, value) in sums.items():
                totals[name] = (unit, value.detach().double() + (totals[name][1] if name in totals else 0))
        self.pending = []
        return totals


def metric_means(sums: dict[str, tuple[str, Tensor]], totals: list[float], global_counts: Mapping[str, int]
                 ) -> dict[str, float]:
    """Each metric's sum over every rank (``totals``, in the order of ``sums``) divided by its unit's global count."""
    return {name: total / max(int(global_counts.get(unit, 0)), 1)
            for (name, (unit, _)), total in zip(sums.items(), totals, strict=True)}


def global_loss(outputs: list[ObjectiveOutput], counts: list[dict[str, int]]) -> tuple[Tensor, dict[str, float]]:
    """The step's loss and metrics from every micro-batch of every process (``outputs`` and their ``counts``).

    The reference for what the trainer computes in pieces (each micro-batch's share weighted by the all-reduced
    counts); tests compare splits of one global batch with it.
    """
    totals: dict[str, int] = {}
    for count in counts:
        for unit, n in count.items():
            totals[unit] = totals.get(unit, 0) + int(n)
    loss = sum(out.loss_sums[unit] / max(totals.get(unit, 0), 1) for out in outputs for unit in out.loss_sums)
    metrics: dict[str, float] = {}
    for out in outputs:
        for name, (unit, value) in out.metric_sums.items():
            metrics[name] = metrics.get(name, 0.0) + float(value) / max(totals.get(unit, 0), 1)
    return torch.as_tensor(loss), metrics


def micro_batch_weights(global_counts: Mapping[str, int], micro_batches: int, world_size: int) -> dict[str, float]:
    """What each unit's summed loss of one micro-batch is multiplied by, given the step's global counts: every
    engine averages the micro-batch losses over micro-batches and processes, so ``sum * accum * world / total``
    averages to ``sum / total`` (the trainer's ``step_loss_weight``, per unit)."""
    return {unit: micro_batches * world_size / max(int(n), 1) for unit, n in global_counts.items()}
