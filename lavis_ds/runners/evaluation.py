"""Evaluation on a held-out split, on every rank: the token-weighted loss, and generated answers."""
from __future__ import annotations

import contextlib

import torch

from lavis_ds.common import comm
from lavis_ds.runners.data import eval_batches, image_name, part_of


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """The module in eval mode, and back in the mode it was found in."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


@torch.no_grad()
def evaluate_loss(trainer, split: str) -> dict:
    """Token-weighted mean loss over a split, on all ranks."""
    engine, sums = trainer.engine, []  # kept on the engine's device: no host synchronisation per batch
    with eval_mode(engine.module):
        for _, _, batch, padding in eval_batches(trainer.data.datasets, split, trainer.run, trainer.rank,
                                                 trainer.world_size):
            out = engine.forward(batch)
            if not padding:
                loss_sum = torch.as_tensor(out["loss_sum"]).detach().double()
                sums.append(torch.stack([loss_sum, torch.as_tensor(out["num_tokens"], device=loss_sum.device).double()]))
    totals = comm.all_reduce(torch.stack(sums).sum(0) if sums else torch.zeros(2, dtype=torch.float64))
    return {"loss": (totals[0] / totals[1].clamp(min=1)).item(), "num_tokens": int(totals[1])}


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
