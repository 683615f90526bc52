"""Randomness as a pure function of where training is, so a resumed run repeats it exactly.

Two sources matter: data augmentation (random crops, flips) and the model's
own randomness (dropout, stochastic depth). Instead of carrying generator
states through checkpoints, both are reseeded from coordinates that a
checkpoint already pins down:

* a sample's augmentation from ``(seed, epoch, sample index)`` - the same
  crop whichever rank, worker or resume loads it;
* an optimizer step's dropout from ``(seed, global step, rank)``.
"""
from __future__ import annotations

import functools
import random

import numpy as np
import torch
from torch.utils.data import Dataset


def derive_seed(*coordinates: int) -> int:
    """A well-mixed 63-bit seed from integer coordinates (NumPy's SeedSequence hashing)."""
    low, high = np.random.SeedSequence([int(c) for c in coordinates]).generate_state(2, dtype=np.uint32)
    return (int(high) << 31) ^ int(low)


def seed_everything(seed: int, accelerators: bool = True) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's on GPUs too, unless told not to)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    # Not torch.manual_seed: it probes every accelerator backend, 0.26 ms per call on a CPU machine,
    # which is 0.3% of a tiny model's step when done every step.
    if accelerators and _has_cuda():
        torch.cuda.manual_seed_all(seed)


@functools.cache
def _has_cuda() -> bool:
    """torch.cuda.is_available(), asked once per process: without a GPU it asks the driver again on every call
    (73 us here, for each step's reseeding)."""
    return torch.cuda.is_available()


class SeededDataset(Dataset):
    """Loads sample ``i`` of ``epoch`` with the global generators seeded from ``(seed, epoch, i)``.

    Processors draw from the global generators (torchvision does); seeding them
    per sample makes augmentation independent of load order, DataLoader workers
    and resumption. The caller's generator states are restored afterwards, so
    loading data never shifts the model's random stream.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):  # e.g. a mixture that draws per epoch
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        python_state, numpy_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):  # data is prepared on the CPU: leave GPU generators alone
            seed_everything(derive_seed(self.seed, self.epoch, index), accelerators=False)
            try:
                return self.dataset[index]
            finally:
                random.setstate(python_state)
                np.random.set_state(numpy_state)

    def __getattr__(self, name: str):
        # collater, image_name, ...: everything else is the wrapped dataset's.
        if name == "dataset":  # not set yet (e.g. during unpickling in a worker)
            raise AttributeError(name)
        return getattr(self.dataset, name)
