"""Batch samplers whose order is a function of (seed, epoch), never of the process.

Training: each epoch is one permutation of the dataset, cut into global
batches of ``micro x accumulation x world`` samples, one per optimizer step.
Global batch ``s`` is ``perm[s*G:(s+1)*G]``; a rank takes its contiguous
slice and splits it into micro-batches. Resuming at step ``s`` starts the
iterator there: nothing already consumed is loaded again.

With a token budget (``TokenBudgetSampler``) the permutation is cut into micro-batches that fill
``rows`` rows of ``row_len`` tokens instead, and ``accum x world`` of them make a step.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, Iterator

import torch


class StepBatchSampler:
    """Yields this rank's micro-batches (index lists), ``accum`` per optimizer step."""

    def __init__(self, num_samples: int, micro_batch: int, accum: int, world_size: int, rank: int,
                 seed: int, shuffle: bool = True, length_of: Callable[[int, int], int] | None = None):
        self.num_samples, self.micro_batch, self.accum = num_samples, micro_batch, accum
        # run.length_grouped: (index, epoch) -> a length to sort each global batch by (datasets.lengths)
        self.length_of = length_of
        self.world_size, self.rank, self.seed, self.shuffle = world_size, rank, seed, shuffle
        self.global_batch = micro_batch * accum * world_size
        # The tail that does not fill a global batch is dropped: every optimizer step sees G samples.
        self.steps_per_epoch = num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"the training set has {num_samples} samples, fewer than one global batch "
                             f"({micro_batch} x {accum} accumulation x {world_size} processes = {self.global_batch})")
        self.epoch, self.start_step = 0, 0

    def set_position(self, epoch: int, start_step: int = 0) -> None:
        """Where the next iteration starts: ``start_step`` optimizer steps into ``epoch``."""
        self.epoch, self.start_step = epoch, start_step

    def permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.permutation(self.epoch)
        for step in range(self.start_step, self.steps_per_epoch):
            yield from self.step_indices(step, perm)

    def step_indices(self, step: int, perm: torch.Tensor | None = None) -> list[list[int]]:
        """This rank's micro-batches (sample indices) of optimizer step ``step`` of the current epoch."""
        perm = self.permutation(self.epoch) if perm is None else perm
        if self.length_of is not None:
            return self._grouped(perm[step * self.global_batch:(step + 1) * self.global_batch].tolist())
        per_rank = self.micro_batch * self.accum
        start = step * self.global_batch + self.rank * per_rank
        mine = perm[start:start + per_rank].tolist()
        return [mine[m * self.micro_batch:(m + 1) * self.micro_batch] for m in range(self.accum)]

    def _grouped(self, global_batch: list[int]) -> list[list[int]]:
        """Length grouping (LLaVA's modality-length grouping, within one optimizer step): the step's samples sorted
        by length and cut into micro-batches of neighbours, dealt to the ranks in turn, so a micro-batch pads to
        a length close to all of its samples and every rank gets short and long ones. The step's samples, and so
        its loss under run.loss_reduction: tokens, are those of the ungrouped order."""
        ordered = sorted(global_batch, key=lambda i: self.length_of(i, self.epoch))
        chunks = [ordered[k * self.micro_batch:(k + 1) * self.micro_batch] for k in range(self.accum * self.world_size)]
        return [chunks[m * self.world_size + self.rank] for m in range(self.accum)]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.accum


def fill_rows(order: list[int], lengths: list[int], rows: int, row_len: int, lookahead: int = 8) -> list[list[int]]:
    """``order`` cut into micro-batches that fill ``rows`` rows of ``row_len`` tokens (``lengths`` by position in
    ``order``, each at most ``row_len``), as packing will lay them out.

    A sample goes to the first row with room. One that fits in no row waits for the next micro-batch, which
    starts with the waiting samples; a micro-batch closes when ``lookahead`` samples wait or the order ends.
    So rows fill up with the shorter samples that follow a long one, and no sample waits for more than a
    few micro-batches. A pure function of its arguments: a resumed epoch plans exactly as before.
    """
    batches: list[list[int]] = []
    waiting: list[tuple[int, int]] = []
    offered = zip(order, (min(n, row_len) for n in lengths), strict=True)
    while True:
        free, batch, passed, queue = [row_len] * rows, [], [], collections.deque(waiting)
        while len(passed) < lookahead and (item := queue.popleft() if queue else next(offered, None)) is not None:
            row = next((r for r, room in enumerate(free) if room >= item[1]), None)
            if row is None:
                passed.append(item)
            else:
                free[row] -= item[1]
                batch.append(item[0])
        if not batch:  # nothing left (the first waiting sample always fits an empty micro-batch)
            return batches
        batches.append(batch)
        waiting = passed + list(queue)


class TokenBudgetSampler(StepBatchSampler):
    """``run.batch_unit: tokens``: micro-batches of as many samples as fill ``rows`` rows of ``row_len`` tokens.

    Each epoch's permutation (the one ``StepBatchSampler`` uses) is cut into micro-batches by the samples'
    estimated tokens (``fill_rows``); optimizer step ``s`` takes micro-batches ``[s*A*W, (s+1)*A*W)``,
    dealt to the ranks in turn. The plan is a function of (seed, epoch, rows, row_len), not of the number
    of processes, so an elastic resume (the same ``A*W``) continues with the same steps. An epoch's step
    count varies a little with its permutation: every epoch of the run takes the fewest any of them has
    (all ``epochs`` are planned up front), dropping the tail as the sample-counted sampler drops the
    samples that do not fill a global batch.
    """

    def __init__(self, num_samples: int, rows: int, row_len: int, accum: int, world_size: int, rank: int, seed: int,
                 length_of: Callable[[int, int], int], epochs: int):
        self.num_samples, self.rows, self.row_len, self.accum = num_samples, rows, row_len, accum
        self.world_size, self.rank, self.seed, self.shuffle, self.length_of = world_size, rank, seed, True, length_of
        self.micro_per_step = accum * world_size
        self._plans: dict[int, list[list[int]]] = {}
        self.steps_per_epoch = min(len(self.plan(epoch)) for epoch in range(epochs)) // self.micro_per_step
        if self.steps_per_epoch == 0:
            raise ValueError(f"the training set's {num_samples} samples fill fewer micro-batches of {rows} x "
                             f"{row_len} tokens than one optimizer step takes ({accum} accumulation x {world_size} "
                             "processes)")
        self.epoch, self.start_step = 0, 0

    def plan(self, epoch: int) -> list[list[int]]:
        """Every micro-batch of ``epoch``, in order (the latest epoch's is kept)."""
        if epoch not in self._plans:
            order = self.permutation(epoch).tolist()
            lengths = [self.length_of(i, epoch) for i in order]
            self._plans = {epoch: fill_rows(order, lengths, self.rows, self.row_len)}
        return self._plans[epoch]

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.steps_per_epoch):
            yield from self.step_indices(step)

    def step_indices(self, step: int, perm: torch.Tensor | None = None) -> list[list[int]]:
        first = step * self.micro_per_step
        return [self.plan(self.epoch)[first + m * self.world_size + self.rank] for m in range(self.accum)]


class EvalBatchSampler:
    """Shards a split over ranks; every rank yields the same number of batches.

    Equal counts matter because a ZeRO-3 forward is a collective. A rank whose
    shard runs out repeats its first batch; ``is_padding(i)`` tells the caller
    to discard the results of batch ``i``.
    """

    def __init__(self, num_samples: int, batch_size: int, world_size: int, rank: int):
        self.indices = list(range(rank, num_samples, world_size))
        self.batch_size = batch_size
        self.num_real = math.ceil(len(self.indices) / batch_size)
        self.num_batches = math.ceil(math.ceil(num_samples / world_size) / batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(self.num_batches):
            j = i if i < self.num_real else 0
            yield self.indices[j * self.batch_size:(j + 1) * self.batch_size] or [0]

    def __len__(self) -> int:
        return self.num_batches

    def is_padding(self, i: int) -> bool:
        return i >= self.num_real
