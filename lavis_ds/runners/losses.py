"""A step's losses as the loop handles them: the weight that normalises a micro-batch's summed token loss, and
the check of the step's losses on every rank before the update is applied."""
from __future__ import annotations

import math

import torch

from lavis_ds.common import comm
from lavis_ds.common.errors import report
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners import faults
from lavis_ds.runners.data import image_name


def can_weigh_by_tokens(run, model: torch.nn.Module) -> bool:
    """Whether the step's loss is its summed token losses over its supervised tokens (``run.loss_reduction:
    tokens`` and a model that prepares its batches on the host and counts their supervised tokens)."""
    return (run.loss_reduction == "tokens" and getattr(model, "supervised_tokens", None) is not None
            and hasattr(model, "prepare_batch"))


def supervised_tokens(model: torch.nn.Module, micro_batches: list[dict]) -> int | None:
    """This rank's supervised tokens of a step's prepared micro-batches (None: the model cannot count them)."""
    counts = [model.supervised_tokens(batch) for batch in micro_batches]
    return None if None in counts else sum(counts)


def step_loss_weight(step_tokens: int | None, accum: int, world_size: int) -> float | None:
    """``run.loss_reduction: tokens``: what each micro-batch's summed token loss is multiplied by
    (``engine.micro_batch_loss``), from the supervised tokens of the whole step over every rank (None: the
    per-micro-batch mean instead).

    Every engine averages its micro-batch losses over micro-batches and ranks, so a micro-batch's loss is
    ``loss_sum * accum * world_size / tokens``: their mean is the step's summed loss over its tokens, the
    same number and gradient however the global batch is split."""
    return None if step_tokens is None else accum * world_size / max(step_tokens, 1)


def check_losses(trainer, losses: torch.Tensor) -> dict:
    """The step's mean loss over every rank and micro-batch; a NaN/inf one is named and handled here.

    One all-reduce tells every rank whether any loss was non-finite, before any rank
    applies the update: `run.on_nonfinite: stop` raises on all of them (the weights and
    checkpoints never see the diverged step), `skip` drops the update on all of them.
    """
    # One all-reduce per optimizer step; ``losses`` stayed on the engine's device until here, so this
    # copy to the host is the step's only synchronisation after the forward the loop itself makes.
    totals = comm.all_reduce(torch.stack([losses.sum(), (~torch.isfinite(losses)).sum().to(losses.dtype)])).tolist()
    if totals[1] == 0:
        return {"loss": totals[0] / (len(losses) * trainer.world_size)}
    where = describe_nonfinite(trainer, losses)
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
    return {"loss": None, "skipped": "nonfinite_loss"}


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
