"""One split of several datasets as one dataset, and the dataset a sample's index falls in.

Shared by the trainer's data side (``runners/data.py``: training and evaluation loaders) and the objectives' passes
over the data (``objectives/reference.py``), which sit below the trainer.
"""
from __future__ import annotations

import bisect

import torch
from torch.utils.data import ConcatDataset


def concat(datasets: dict[str, dict], splits) -> torch.utils.data.Dataset:
    """The samples of ``splits`` of every dataset (``{name: {split: Dataset}}``) that has them, in that order."""
    parts = [per_split[s] for per_split in datasets.values() for s in splits if s in per_split]
    if not parts:
        raise ValueError(f"no dataset has split(s) {list(splits)}")
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)


def part_of(dataset, index: int) -> tuple[int, torch.utils.data.Dataset, int]:
    """(number of the part, the part, the index inside it) of a ConcatDataset's sample; (0, dataset, index) else."""
    if not isinstance(dataset, ConcatDataset):
        return 0, dataset, index
    d = bisect.bisect_right(dataset.cumulative_sizes, index)
    return d, dataset.datasets[d], index - (dataset.cumulative_sizes[d - 1] if d else 0)
