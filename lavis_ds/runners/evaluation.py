"""Evaluation on a held-out split, on every rank: the token-weighted loss, and generated answers."""
from __future__ import annotations

import torch

from lavis_ds.common import comm
from lavis_ds.common.modes import eval_mode
from lavis_ds.objectives import PAIRS, TOKENS
from lavis_ds.objectives.base import metric_means
from lavis_ds.datasets.splits import part_of
from lavis_ds.runners.data import eval_batches, image_name


@torch.no_grad()
def evaluate_loss(trainer, split: str) -> dict:
    """A split's loss over all ranks, normalised as the objective's training loss (``objectives.base``: each term
    over its unit's count in the split), and the objective's metrics (e.g. DPO's rewards on held-out pairs)."""
    engine, objective, model = trainer.engine, trainer.data.objective, trainer.engine.model
    units = objective.UNITS
    sums, counts = [], []  # kept on the engine's device: no host synchronisation per batch
    objective.take_metric_sums()  # nothing of the training steps' left
    metric_sums: dict = {}
    with eval_mode(engine.module):
        for _, _, batch, padding in eval_batches(trainer.data.datasets, split, trainer.run, trainer.rank,
                                                 trainer.world_size):
            batch = objective.prepare(model, batch)
            out = engine.forward(batch)
            # a padding batch's metrics count zero, but count: every rank then reduces the same metric names
            for name, (unit, value) in objective.take_metric_sums().items():
                value = value * 0 if padding else value
                metric_sums[name] = (unit, value + metric_sums[name][1] if name in metric_sums else value)
            if padding:
                continue
            if "loss_sums" in out:  # scored by the objective
                loss_sums, batch_counts = out["loss_sums"], objective.counts(model, batch)
            else:  # the model's own next-token loss
                loss_sums, batch_counts = {TOKENS: out["loss_sum"]}, {TOKENS: out["num_tokens"]}
            sums.append(torch.stack([torch.as_tensor(loss_sums.get(unit, 0.0)).detach().double().reshape(())
                                     for unit in units]))
            counts.append(batch_counts)
    mine = torch.stack(sums).sum(0).cpu() if sums else torch.zeros(len(units), dtype=torch.float64)
    unit_totals = [float(sum(int(c.get(unit, 0)) for c in counts)) for unit in units]
    values = torch.cat([mine, torch.tensor(unit_totals, dtype=torch.float64),
                        torch.stack([v.cpu() for _, v in metric_sums.values()]) if metric_sums else torch.zeros(0,
                        dtype=torch.float64)])
    totals = comm.all_reduce(values.double()).tolist()
    loss_totals, unit_counts = totals[:len(units)], dict(zip(units, totals[len(units):2 * len(units)]))
    loss = sum(total / max(unit_counts[unit], 1) for unit, total in zip(units, loss_totals))
    names = {TOKENS: "num_tokens", PAIRS: "num_pairs"}
    result = {"loss": loss, **{names.get(unit, f"num_{unit}"): int(count) for unit, count in unit_counts.items()
                               if count or unit == units[0]}}
    return {**result, **metric_means(metric_sums, totals[2 * len(units):], unit_counts)}


@torch.no_grad()
def generate_split(trainer, split: str) -> list[dict]:
    """Generate an answer for every sample of a split; the full list on every rank, in index order.

    Each result: ``index``, ``dataset`` (its section), ``image``, ``prompt`` (the last instruction),
    ``references`` (every acceptable answer), ``expected`` (the first) and ``generated``.
    """
    kwargs = {"max_new_tokens": 30, "num_beams": 1, **dict(trainer.run.generate)}
    datasets = trainer.data.datasets
    sections = [name for name, per_split in datasets.items() if split in per_split]  # concat's order
    mine = []
    with eval_mode(trainer.engine.module):
        for dataset, indices, batch, padding in eval_batches(datasets, split, trainer.run, trainer.rank,
                                                             trainer.world_size):
            texts = trainer.engine.generate(batch, **kwargs)
            if padding:
                continue
            references = batch.get("references") or [output[-1:] for output in batch["output"]]
            for index, text, instruction, refs in zip(indices, texts, batch["instruction"], references, strict=True):
                mine.append({"index": index, "dataset": sections[part_of(dataset, index)[0]],
                             "image": image_name(dataset, index), "prompt": instruction[-1],
                             "references": list(refs), "expected": refs[0], "generated": text})
    gathered = comm.all_gather_object(mine)
    return sorted((r for part in gathered for r in part), key=lambda r: r["index"])
