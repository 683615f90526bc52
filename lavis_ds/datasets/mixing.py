"""Several training datasets in one epoch, in proportions set by each section's ``sample_ratio``.

An epoch has as many samples as the datasets together (the length a plain
concatenation would have); dataset ``d`` gets the share ``ratio_d / sum(ratios)``
of it, rounded so that the shares add up exactly (largest remainder).

Which records fill a dataset's share is a pure function of (seed, epoch, index):
each dataset has an endless stream of passes, pass ``p`` being a permutation of
its records drawn from a generator seeded by (seed, dataset name, p), and epoch
``e`` takes the stream's positions ``[e * share, (e + 1) * share)``. So a dataset
whose share is smaller than itself is covered without repeats across epochs
(sampling without replacement within a pass), and one whose share is larger is
repeated in whole passes (oversampling). Nothing depends on rank, world size or
iteration state: the trainer's ``StepBatchSampler`` permutes the epoch's indices
with (seed, epoch), and this dataset maps an epoch-local index to
(dataset, record). ``set_epoch`` must be called before each epoch's DataLoader
iterator is created (workers copy the dataset then).
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch
from torch.utils.data import ConcatDataset, Dataset

from lavis_ds.common import dist


def apportion(total: int, ratios: Mapping[str, float]) -> dict[str, int]:
    """Integer shares of ``total`` proportional to ``ratios``, summing to ``total`` (largest remainder).

    Ties go to the dataset named first, so the result depends on nothing but the arguments.
    """
    weight = sum(ratios.values())
    exact = {name: total * ratio / weight for name, ratio in ratios.items()}
    shares = {name: math.floor(x) for name, x in exact.items()}
    order = sorted(exact, key=lambda name: -(exact[name] - shares[name]))  # stable: ties keep section order
    for name in order[: total - sum(shares.values())]:
        shares[name] += 1
    return shares


def _pass_seed(seed: int, name: str, pass_number: int) -> int:
    # A hash, not arithmetic on the numbers: passes of different datasets and seeds never share a stream.
    digest = hashlib.blake2b(f"{seed}/{name}/{pass_number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _collater_of(dataset: Dataset):
    return dataset.datasets[0].collater if isinstance(dataset, ConcatDataset) else dataset.collater


class MixedDataset(Dataset):
    """Datasets mixed by ratio; index ``i`` of epoch ``e`` is a fixed (dataset, record).

    Args:
        parts: name -> dataset, in section order.
        ratios: name -> positive weight.
        seed: with the epoch, determines which records fill each share.
        length: samples per epoch (default: the datasets' total length).
    """

    def __init__(self, parts: Mapping[str, Dataset], ratios: Mapping[str, float], seed: int,
                 length: int | None = None):
        if set(parts) != set(ratios):
            raise ValueError(f"MixedDataset: datasets {sorted(parts)} and ratios {sorted(ratios)} name different sets")
        for name, ratio in ratios.items():
            if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
                raise ValueError(f"datasets.{name}.sample_ratio: must be a positive number, got {ratio!r}")
        self.names = list(parts)
        self.parts = [parts[name] for name in self.names]
        self.sizes = [len(part) for part in self.parts]
        for name, size in zip(self.names, self.sizes):
            if size == 0:
                raise ValueError(f"datasets.{name}: has no training samples to mix")
        self.seed = seed
        self.length = sum(self.sizes) if length is None else length
        self.shares = apportion(self.length, {name: ratios[name] for name in self.names})
        self.starts = [0]  # epoch-local index where each dataset's block starts
        for name in self.names:
            self.starts.append(self.starts[-1] + self.shares[name])
        self.collater = _collater_of(self.parts[0])
        self.epoch = 0
        self._passes: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def locate(self, index: int, epoch: int | None = None) -> tuple[int, int]:
        """(dataset number, record index) of epoch-local ``index`` in ``epoch`` (default: the current one)."""
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for a mixed epoch of {self.length} samples")
        epoch = self.epoch if epoch is None else epoch
        d = bisect.bisect_right(self.starts, index) - 1
        position = epoch * self.shares[self.names[d]] + (index - self.starts[d])
        pass_number, offset = divmod(position, self.sizes[d])
        return d, int(self._permutation(d, pass_number)[offset])

    def __getitem__(self, index: int) -> Any:
        d, record = self.locate(index)
        return self.parts[d][record]

    def _permutation(self, d: int, pass_number: int) -> torch.Tensor:
        key = (d, pass_number)
        if key not in self._passes:
            g = torch.Generator().manual_seed(_pass_seed(self.seed, self.names[d], pass_number))
            self._passes[key] = torch.randperm(self.sizes[d], generator=g)
            while len(self._passes) > 2 * len(self.parts):  # an epoch touches at most ~2 passes per dataset
                self._passes.popitem(last=False)
        else:
            self._passes.move_to_end(key)
        return self._passes[key]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_passes": OrderedDict()}  # workers rebuild what they need

    def describe(self) -> str:
        return ", ".join(f"{name} {self.shares[name]} ({self.shares[name] / size:.2f} x its {size} records)"
                         for name, size in zip(self.names, self.sizes))


def ratio_problems(ratios: Mapping[str, Any]) -> list[str]:
    """``sample_ratio`` must be set on every training dataset or on none (``ratios``: name -> value or None)."""
    given = [name for name, ratio in ratios.items() if ratio is not None]
    if not given or len(given) == len(ratios):
        return []
    return [f"datasets.{name}.sample_ratio: missing; datasets {', '.join(given)} set sample_ratio, and the "
            f"ratios only make sense when every training dataset has one"
            for name, ratio in ratios.items() if ratio is None]


def mix_train_splits(datasets: Mapping[str, Mapping[str, Dataset]], sections: Mapping[str, Mapping],
                     splits: Sequence[str], seed: int) -> MixedDataset | None:
    """The training set mixed by the sections' ``sample_ratio``; ``None`` when no ratio applies.

    ``None`` (no dataset section sets a ratio, or only one dataset trains) means: concatenate as
    before. A section with several training splits takes part as their concatenation.
    """
    parts = {}
    for name, per_split in datasets.items():
        mine = [per_split[s] for s in splits if s in per_split]
        if mine:
            parts[name] = mine[0] if len(mine) == 1 else ConcatDataset(mine)
    ratios = {name: (sections.get(name) or {}).get("sample_ratio") for name in parts}
    if len(parts) < 2 or all(r is None for r in ratios.values()):
        return None
    problems = ratio_problems(ratios)
    if problems:
        raise ValueError("\n".join(problems))
    mixed = MixedDataset(parts, ratios, seed)
    if dist.is_main_process():  # once per run, where the trainer reports too
        print(f"mixing {len(parts)} datasets by sample_ratio, {len(mixed)} samples per epoch: {mixed.describe()}",
              flush=True)
    return mixed
