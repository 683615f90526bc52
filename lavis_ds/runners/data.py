"""The data side of the loop: the training set and its order, each step's micro-batches prepared on the host, and
the evaluation batches of a split."""
from __future__ import annotations

import functools

import torch
from omegaconf import DictConfig
from torch.utils.data import ConcatDataset, DataLoader

from lavis_ds.common.errors import LavisDsError
from lavis_ds.common.run_config import batch_unit
from lavis_ds.common.seeding import SeededDataset
from lavis_ds.datasets.lengths import approximate_length, counted_by, token_length_of
from lavis_ds.datasets.mixing import mix_train_splits
from lavis_ds.datasets.samplers import EvalBatchSampler, StepBatchSampler, TokenBudgetSampler
from lavis_ds.datasets.splits import concat, part_of
from lavis_ds.objectives import Objective, build_objective
from lavis_ds.runners import faults


class TrainData:
    """The training set, its sampler and loader (``build``, once the batch layout is settled), and ``next_step``:
    one optimizer step's micro-batches, prepared for the model."""

    def __init__(self, cfg: DictConfig, model: torch.nn.Module, datasets: dict[str, dict], rank: int,
                 world_size: int, objective: Objective | None = None):
        """Plain assignments and the mixing of the training splits (no disk, no collectives). ``objective``: what
        prepares each micro-batch and scores it (default: the one ``run.task`` names)."""
        self.run, self.model, self.datasets = cfg.run, model, datasets
        self.objective = objective if objective is not None else build_objective(cfg.run)
        self.max_txt_len = cfg.model.get("max_txt_len")
        self.rank, self.world_size = rank, world_size
        self.train_set = None
        self.sampler, self.loader = None, None  # build()'s
        self.steps_per_epoch, self.accum = 0, 1  # build()'s
        self.failure: LavisDsError | None = None  # a step's micro-batches that failed to load, until agreed on
        if self.run.train_splits:
            # sample_ratio on the sections: each epoch draws from them by ratio; else one concatenation.
            mixed = mix_train_splits(datasets, cfg.datasets, self.run.train_splits, self.run.seed)
            # Augmentation is a function of (seed, epoch, sample index): a resumed epoch repeats it exactly.
            self.train_set = SeededDataset(mixed or concat(datasets, self.run.train_splits), self.run.seed)

    def build(self, micro_batch: int, accum: int) -> None:
        """The sampler and loader for this batch layout."""
        self.accum = accum
        if self.train_set is not None:
            self.sampler = self._sampler(micro_batch, accum)
            self.steps_per_epoch = self.sampler.steps_per_epoch
            self.loader = make_loader(self.train_set, self.sampler, self.run)

    def _sampler(self, micro_batch: int, accum: int) -> StepBatchSampler:
        """Micro-batches of ``batch_size_train`` samples (sorted within each step by ``run.length_grouped``), or
        filled to ``batch_size_train x max_seq_len`` tokens (``run.batch_unit``)."""
        run = self.run
        if batch_unit(run) != "tokens":
            length_of = functools.partial(approximate_length, self.train_set) if run.length_grouped else None
            return StepBatchSampler(len(self.train_set), micro_batch, accum, self.world_size, self.rank,
                                    seed=run.seed, length_of=length_of)
        longest = min(run.max_seq_len, self.max_txt_len or run.max_seq_len)  # truncation
        length_of = token_length_of(self.train_set, counted_by(self.model.prepare_batch), longest,
                                    getattr(getattr(getattr(self.model, "image_path", None), "layout", None),
                                            "tokens_for_image", None))
        sampler = TokenBudgetSampler(len(self.train_set), micro_batch, run.max_seq_len, accum, self.world_size,
                                     self.rank, run.seed, length_of, run.max_epoch)
        if self.rank == 0:
            print(f"lavis_ds: run.batch_unit=tokens: micro-batches of {sampler.rows} rows of {sampler.row_len} tokens, "
                  f"{sampler.steps_per_epoch} optimizer steps per epoch; {length_of.estimate}", flush=True)
        return sampler

    def epoch(self, epoch: int, step_in_epoch: int):
        """The micro-batches of ``epoch`` from its step ``step_in_epoch`` on (an iterator for ``next_step``)."""
        self.sampler.set_position(epoch, step_in_epoch)
        self.train_set.set_epoch(epoch)  # before iter(): DataLoader workers copy the dataset then
        return iter(self.loader)

    def steps(self, epoch: int, step_in_epoch: int):
        """Yield ``(micro_batches, load_following)`` for each step of ``epoch`` from ``step_in_epoch`` on: this rank's
        prepared micro-batches, and a function that loads the next step's (None at the epoch's last step), which
        the loop calls during the step, before the loss check that also agrees on the next step."""
        batches, loaded = self.epoch(epoch, step_in_epoch), []

        def load_following() -> list[dict]:
            loaded.append(self.next_step(batches))
            return loaded[-1]

        for left in range(self.steps_per_epoch - step_in_epoch, 0, -1):
            yield loaded.pop() if loaded else self.next_step(batches), load_following if left > 1 else None

    def next_step(self, micro_batches) -> list[dict]:
        """This rank's micro-batches of the next optimizer step, prepared. A sample that fails to load (an image
        that does not decode, raised in a DataLoader worker) is kept as ``failure`` for the step's agreement,
        which stops every rank with it; then no batch comes back."""
        try:
            return self.prepare([next(micro_batches) for _ in range(self.accum)])
        except LavisDsError as e:
            self.failure = e
            return []

    def prepare(self, micro_batches: list[dict]) -> list[dict]:
        """What the objective does on the host before a step, once per micro-batch (``Objective.prepare``: the
        model's tokenizing; with ``run.packing``, laying the samples end to end in rows of ``run.max_seq_len``)."""
        pack_to = self.run.max_seq_len if self.run.packing else None
        return [self.objective.prepare(self.model, batch, pack_to) for batch in micro_batches]

    def take_failure(self) -> LavisDsError | None:
        failure, self.failure = self.failure, None
        return failure


def eval_batches(datasets: dict[str, dict], split: str, run, rank: int, world_size: int):
    """Yield ``(dataset, indices, batch, is_padding)`` for this rank's shard of a split.

    Every rank runs the same number of batches (ZeRO-3 forwards are collective); padding batches are flagged:
    run them, discard their results. ``indices`` index ``dataset`` (not ``batch["index"]``, which is per part of
    a ConcatDataset).
    """
    dataset = concat(datasets, [split])
    sampler = EvalBatchSampler(len(dataset), run.batch_size_eval, world_size, rank)
    for i, (indices, batch) in enumerate(zip(sampler, make_loader(dataset, sampler, run))):
        yield dataset, indices, batch, sampler.is_padding(i)


def make_loader(dataset, batch_sampler, run) -> DataLoader:
    first = dataset.dataset if isinstance(dataset, SeededDataset) else dataset
    first = first.datasets[0] if isinstance(first, ConcatDataset) else first
    # Workers leave SIGTERM/SIGINT to this process, which stops at a step boundary.
    # Pinned host memory on CUDA: the batch's copy to the GPU (non_blocking, common.precision) can then
    # overlap the step instead of waiting for a pageable-memory staging copy.
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=first.collater,
                      num_workers=run.num_workers, persistent_workers=False, pin_memory=torch.cuda.is_available(),
                      worker_init_fn=faults.ignore_stop_signals if run.num_workers else None)


def image_name(dataset, index: int) -> str | None:
    """The image file of a sample, for reports and predictions (None if the dataset cannot say)."""
    _, part, local = part_of(dataset, index)
    image_of = getattr(part, "image_name", None)
    return image_of(local) if image_of else None
