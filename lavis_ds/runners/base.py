"""The training loop every runner shares, and evaluation.

A runner is ``RunnerBase`` on an engine: a subclass says how to wrap the model (``wrap``), accumulate
the gradients of a step (``forward_backward``) and apply them (``optimizer_step``), run a forward pass
(``forward``), and check, save and load a checkpoint (``runners/engine.py`` lists what it provides).
Everything else - data order, LR schedule, hooks, what stops a run on every rank (signals, failed loads,
non-finite losses) - is here, once; which checkpoint a run continues is ``runners/resume.py``, and
continuing another engine's checkpoint ``runners/handover.py``.

Building a runner touches neither the disk nor the other processes: ``setup`` (the first thing
``train`` and ``evaluate_only`` do) resolves the checkpoint to resume from, then builds what depends on
it - batch layout, data order, engine, LR schedule, hooks.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
import signal
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import ConcatDataset, DataLoader

from lavis_ds.common import comm, dist
from lavis_ds.common.errors import LavisDsError, report
from lavis_ds.common.registry import registry
from lavis_ds.common.run_config import batch_unit
from lavis_ds.common.seeding import SeededDataset, derive_seed, seed_everything
from lavis_ds.datasets.lengths import approximate_length, counted_by, token_length_of
from lavis_ds.datasets.mixing import mix_train_splits
from lavis_ds.datasets.samplers import EvalBatchSampler, StepBatchSampler, TokenBudgetSampler
from lavis_ds.optim import build_param_groups
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners import faults, throughput
from lavis_ds.runners.engine import Engine
from lavis_ds.runners.handover import EngineSwitch
from lavis_ds.runners.hooks import build_hooks
from lavis_ds.runners.resume import ResumePolicy, TrainState


# Events every rank dispatches together, after which the ranks agree on a failure one of them deferred (after_step
# leaves it to the next step's agreement, which every step makes anyway).
AGREED_EVENTS = ("before_train", "after_epoch", "after_train", "evaluate")


class RunnerBase(ResumePolicy, EngineSwitch, Engine):
    """Owns the loop; subclasses own the engine."""

    def __init__(self, cfg: DictConfig, model: torch.nn.Module, datasets: dict[str, dict]):
        """Plain assignments (no disk, no collectives): ``setup`` does the rest, once every rank is here."""
        self.cfg, self.run = cfg, cfg.run
        self.model, self.datasets = model, datasets
        self.rank, self.world_size = dist.rank(), dist.world_size()
        self.output_dir = Path(self.run.output_dir)
        self.state = TrainState()
        self.saved_step: int | None = None  # the step of the newest checkpoint this run saved or resumed from
        self.resume_from: tuple[Path, str] | None = None  # (load_dir, tag), settled by setup()
        self.hooks: list = []  # build_hooks(self), in setup()
        self.is_set_up = False
        self.train_set = None
        if self.run.train_splits:
            # sample_ratio on the sections: each epoch draws from them by ratio; else one concatenation.
            mixed = mix_train_splits(datasets, cfg.datasets, self.run.train_splits, self.run.seed)
            # Augmentation is a function of (seed, epoch, sample index): a resumed epoch repeats it exactly.
            self.train_set = SeededDataset(mixed or self._concat(self.run.train_splits), self.run.seed)

    def setup(self) -> None:
        """The checkpoint to resume from, then what depends on it: batch layout, data order, engine, schedule, hooks.

        Collective (every rank checks the checkpoint's files, and the engine's start may be), and it may set a
        damaged checkpoint aside (``run.resume: auto``). ``train`` and ``evaluate_only`` call it; a caller that
        steps the runner itself (a benchmark) calls it first. Once: a second call does nothing.
        """
        if self.is_set_up:
            return
        self.resume_from = self.resume_source()
        # Before wrap: an elastic resume changes the accumulation, and the engine is built for its batch layout.
        self.micro_batch, self.accum, self.global_batch = self._batch_sizes()
        if self.train_set is not None:
            self.sampler = self._train_sampler()
            self.steps_per_epoch = self.sampler.steps_per_epoch
            self.train_loader = self._loader(self.train_set, self.sampler)
        else:
            self.steps_per_epoch = 0
        self.total_steps = self.steps_per_epoch * self.run.max_epoch

        param_groups = build_param_groups(self.model, self.run.weight_decay, dict(self.run.lr_scales))
        self.optimizer = self.wrap(self.model, param_groups)
        self.scheduler = registry.get_lr_scheduler_class(self.run.lr_sched).from_config(
            self.optimizer, self.run, total_steps=max(1, self.total_steps), steps_per_epoch=max(1, self.steps_per_epoch))
        self.hooks = build_hooks(self)
        self.is_set_up = True

    def _train_sampler(self) -> StepBatchSampler:
        """The training data order: micro-batches of ``batch_size_train`` samples (sorted within each step by
        ``run.length_grouped``), or filled to ``batch_size_train x max_seq_len`` tokens (``run.batch_unit``)."""
        if batch_unit(self.run) != "tokens":
            length_of = functools.partial(approximate_length, self.train_set) if self.run.length_grouped else None
            return StepBatchSampler(len(self.train_set), self.micro_batch, self.accum, self.world_size, self.rank,
                                    seed=self.run.seed, length_of=length_of)
        longest = min(self.run.max_seq_len, self.cfg.model.get("max_txt_len") or self.run.max_seq_len)  # truncation
        length_of = token_length_of(self.train_set, counted_by(self.model.prepare_batch), longest)
        sampler = TokenBudgetSampler(len(self.train_set), self.micro_batch, self.run.max_seq_len, self.accum,
                                     self.world_size, self.rank, self.run.seed, length_of, self.run.max_epoch)
        if self.rank == 0:
            print(f"lavis_ds: run.batch_unit=tokens: micro-batches of {sampler.rows} rows of {sampler.row_len} tokens, "
                  f"{sampler.steps_per_epoch} optimizer steps per epoch; {length_of.estimate}", flush=True)
        return sampler

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        self.setup()
        self.resume()
        if self.already_finished():
            return
        if self.rank == 0:  # from an earlier run in this folder (run.resume=false): not this run's
            self.finished_file.unlink(missing_ok=True)
        with faults.SignalCatcher() as self.signals:
            try:
                self.call_hooks("before_train")  # inside the try: a hook that fails here still closes the others
                self.module.train()  # once: evaluation restores the mode it found
                for epoch in range(self.state.epoch, self.run.max_epoch):
                    self.sampler.set_position(epoch, self.state.step_in_epoch)
                    self.train_set.set_epoch(epoch)  # before iter(): DataLoader workers copy the dataset then
                    micro_batches = iter(self.train_loader)
                    for _ in range(self.state.step_in_epoch, self.steps_per_epoch):
                        self.run_step(self.next_micro_batches(micro_batches))
                    self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
                    self.call_hooks("after_epoch")
                self.call_hooks("after_train")
            finally:
                self.close()
        if self.rank == 0:  # last: a run killed during its final evaluation evaluates again when rerun
            self.finished_file.write_text(json.dumps({"global_step": self.state.global_step}))

    @property
    def finished_file(self) -> Path:
        return self.output_dir / "finished.json"

    def already_finished(self) -> bool:
        """Whether this is a rerun of a run that completed, final evaluation included; says so if it is."""
        done = (self.state.global_step >= self.total_steps and self.finished_file.is_file()
                and json.loads(self.finished_file.read_text()).get("global_step") == self.state.global_step)
        if done and self.rank == 0:
            print(f"lavis_ds: this run already finished at step {self.state.global_step} (results in "
                  f"{self.output_dir / 'metrics.jsonl'}); nothing to do. To train longer raise run.max_epoch; "
                  "to start over pass --options run.resume=false or use another run.output_dir.", flush=True)
        return done

    def next_micro_batches(self, micro_batches) -> list[dict]:
        """This rank's micro-batches of the next optimizer step, once every rank agreed to take it.

        The agreement (one all-reduce of two integers) carries what ends a run early: a signal
        any rank received, or a sample that failed to load on any rank.
        """
        batches, error = [], None
        try:
            batches = [next(micro_batches) for _ in range(self.accum)]
        except LavisDsError as e:  # e.g. an image that does not decode, raised in a DataLoader worker
            error = e
        if signum := faults.agree(self.signals.received, error or self.hooks.take_failure()):
            self.call_hooks("on_stop", signum)  # the Checkpointer asks for a save on SIGTERM
            stopped = faults.Stopped(signum, self._stop_message(signum))
            stopped.quiet = self.rank != 0  # every rank stops here; one says so
            raise stopped
        return batches

    def run_step(self, micro_batches: list[dict]) -> None:
        """One optimizer step and everything around it: its lr, the counters, the hooks."""
        lr = self.scheduler.get_lr()
        # Dropout & co. draw from (seed, step, rank): a resumed step draws what the original one did.
        seed_everything(derive_seed(self.run.seed, self.state.global_step, self.rank))
        self.prepare_micro_batches(micro_batches)
        self.loss_weight = self.step_loss_weight(micro_batches)
        tokens = throughput.count_tokens(self.module, micro_batches)  # on the CPU, from the prepared batches
        losses = self.forward_backward(micro_batches)  # gradients accumulated, not applied yet
        metrics = self.check_losses(losses)  # a non-finite loss stops the run here, or skips the update
        metrics.update(self.optimizer_step(apply="skipped" not in metrics))
        self.scheduler.step()  # once per optimizer step, never per micro-batch
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        self.call_hooks("after_step", {**metrics, "lr": lr, "tokens": tokens})

    def prepare_micro_batches(self, micro_batches: list[dict]) -> None:
        """What the model does on the host before the step (``prepare_batch``: tokenizing; with ``run.packing``,
        laying the samples end to end in rows of ``run.max_seq_len`` tokens), in place."""
        prepare = getattr(self.model, "prepare_batch", None)
        if prepare is not None:
            packing = {"pack_to": self.run.max_seq_len} if self.run.packing else {}
            micro_batches[:] = [prepare(batch, **packing) for batch in micro_batches]

    def step_loss_weight(self, micro_batches: list[dict]) -> float | None:
        """``run.loss_reduction: tokens``: what each micro-batch's summed token loss is multiplied by (see
        ``micro_batch_loss``), from one all-reduce of the step's supervised tokens over every rank. The batches
        are prepared on the host here (the model tokenizes them), so counting needs no device sync.

        Every engine averages its micro-batch losses over micro-batches and ranks, so a micro-batch's loss is
        ``loss_sum * accum * world_size / tokens``: their mean is the step's summed loss over its tokens, the
        same number and gradient however the global batch is split. None: the per-micro-batch mean instead."""
        count = getattr(self.model, "supervised_tokens", None)
        if self.run.loss_reduction != "tokens" or count is None or not hasattr(self.model, "prepare_batch"):
            return None
        counts = [count(batch) for batch in micro_batches]
        if None in counts:  # a model that cannot count its tokens: its own per-micro-batch mean
            return None
        tokens = int(comm.all_reduce(torch.tensor([sum(counts)], dtype=torch.int64))[0])
        return len(micro_batches) * self.world_size / max(tokens, 1)

    def micro_batch_loss(self, out: dict) -> torch.Tensor:
        """The loss a runner backpropagates for one micro-batch (``forward``'s output), as engines average them."""
        weight = getattr(self, "loss_weight", None)
        return out["loss"] if weight is None else out["loss_sum"] * weight

    def check_losses(self, losses: torch.Tensor) -> dict:
        """The step's mean loss over every rank and micro-batch; a NaN/inf one is named and handled here.

        One all-reduce tells every rank whether any loss was non-finite, before any rank
        applies the update: `run.on_nonfinite: stop` raises on all of them (the weights and
        checkpoints never see the diverged step), `skip` drops the update on all of them.
        """
        # One all-reduce per optimizer step; ``losses`` stayed on the engine's device until here, so this
        # copy to the host is the step's only synchronisation the loop itself makes.
        totals = comm.all_reduce(torch.stack([losses.sum(), (~torch.isfinite(losses)).sum().to(losses.dtype)]))
        if totals[1] == 0:
            return {"loss": totals[0].item() / (len(losses) * self.world_size)}
        where = self._describe_nonfinite(losses)
        if self.run.on_nonfinite == "stop":
            latest = ckpt.latest_complete(self.checkpoint_dir)
            error = faults.NonFiniteLoss(
                f"{where}. run.on_nonfinite=stop: stopped before this optimizer step, so no weight and no checkpoint "
                f"holds a diverged value; `run.resume: auto` continues from "
                f"{latest or 'the start (no checkpoint yet)'}. Set run.on_nonfinite=skip to drop such steps and go on")
            error.quiet = self.rank != 0  # every rank raises it; one prints it
            raise error
        if self.rank == 0:
            report(f"{where}. run.on_nonfinite=skip: this optimizer step is skipped (no parameter update)")
        return {"loss": None, "skipped": "nonfinite_loss"}

    def _describe_nonfinite(self, losses: torch.Tensor) -> str:
        """Step, rank, micro-batch and samples of every non-finite loss (collective: gathers from all ranks)."""
        indices = self.sampler.step_indices(self.state.step_in_epoch)
        mine = [(m, float(loss), indices[m]) for m, loss in enumerate(losses.tolist()) if not math.isfinite(loss)]
        parts = []
        for rank, bad in enumerate(comm.all_gather_object(mine)):
            for m, value, samples in bad:
                names = [name for i in samples[:4] if (name := _image_name(self.train_set.dataset, i))]
                parts.append(f"rank {rank}, micro-batch {m + 1} of {self.accum}: {value} (training samples "
                             f"{', '.join(map(str, samples))}" + (f"; images {', '.join(names)}" if names else "") + ")")
        return (f"non-finite loss at optimizer step {self.state.global_step + 1} (epoch {self.state.epoch}): "
                + "; ".join(parts))

    def _stop_message(self, signum: int) -> str:
        latest = ckpt.latest_complete(self.checkpoint_dir)
        step, name = self.state.global_step, signal.Signals(signum).name
        if self.saved_step == step and latest is not None and signum == signal.SIGTERM:
            return (f"stopped by {name} after optimizer step {step}: saved {latest}; "
                    f"run the same command to continue from there")
        return (f"stopped by {name} after optimizer step {step} without saving; the same command continues from "
                f"{latest or 'the start (no checkpoint yet)'}")

    def evaluate_only(self) -> None:
        """`run.evaluate: true`: load the checkpoint named by `run.resume`, evaluate it, stop."""
        self.setup()
        self.resume()
        try:
            self.call_hooks("before_train")
            self.call_hooks("evaluate")
        finally:
            self.close()

    def close(self) -> None:
        """The hooks release what they made (writer, progress bar); called once, however the run ends."""
        self.call_hooks("close")

    def call_hooks(self, event: str, *args, **kwargs) -> None:
        """Dispatch ``event`` to every hook in run order (``hooks.HookList``); then cut the checkpoint any of them
        asked for (``request_save``), once: a save never runs inside a hook, and its after_save reaches them all.
        A step that is saved already (an epoch end that SIGTERM stopped at) is not saved twice."""
        if self.hooks.call(event, *args, **kwargs) and self.saved_step != self.state.global_step:
            self.save()
        if event in AGREED_EVENTS:  # what one rank could not write stops every rank here (HookList.defer)
            faults.agree(0, self.hooks.take_failure())

    def request_save(self, reason: str) -> None:
        """Ask for a checkpoint of this step, from a hook handling after_step, after_epoch or on_stop. A save is
        collective: every rank must ask (hooks decide from the step counters, which every rank shares)."""
        self.hooks.request_save(reason)

    # ------------------------------------------------------------- checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def save(self) -> Path:
        """Save on every rank (DeepSpeed requires it), then mark the folder complete."""
        tag = ckpt.tag_for(self.state.global_step)
        client_state = {"lavis_ds": {"train_state": asdict(self.state), "scheduler": self.scheduler.state_dict(),
                                     "world_size": self.world_size, "config": OmegaConf.to_yaml(self.cfg)}}
        tag_dir, error = self.checkpoint_dir / tag, None
        try:
            self.save_checkpoint(tag, client_state)
            torch.save(ckpt.rng_states(), ckpt.rng_file(tag_dir, self.rank))
        except (OSError, RuntimeError) as e:  # a full or failing disk (torch.save says RuntimeError): every rank
            error = ckpt.save_failure(e, tag_dir)  # stops, the previous checkpoint stays the newest
            if error is None:
                raise
        faults.agree(0, error)  # also the barrier: every rank has written everything before the marker says so
        if self.rank == 0:
            try:
                ckpt.mark_complete(tag_dir, {
                    "global_step": self.state.global_step, "epoch": self.state.epoch,
                    "world_size": self.world_size, "global_batch": self.global_batch, **self.checkpoint_layout()})
            except OSError as e:
                error = ckpt.save_failure(e, tag_dir)
        faults.agree(0, error)  # the marker too may meet a full disk
        self.call_hooks("after_save", tag_dir)  # scoring and pruning (BestCheckpoint)
        comm.barrier()
        self.saved_step = self.state.global_step
        return tag_dir

    # -------------------------------------------------------------- evaluation
    def _eval_batches(self, split: str):
        """Yield ``(dataset, indices, batch, is_padding)`` for this rank's shard of a split, in eval mode.

        Every rank runs the same number of batches (ZeRO-3 forwards are collective);
        padding batches are flagged: run them, discard their results. ``indices`` index ``dataset``
        (not ``batch["index"]``, which is per part of a ConcatDataset).
        """
        dataset = self._concat([split])
        sampler = EvalBatchSampler(len(dataset), self.run.batch_size_eval, self.world_size, self.rank)
        was_training = self.module.training
        self.module.eval()
        try:
            for i, (indices, batch) in enumerate(zip(sampler, self._loader(dataset, sampler))):
                yield dataset, indices, batch, sampler.is_padding(i)
        finally:
            self.module.train(was_training)

    @torch.no_grad()
    def evaluate_loss(self, split: str) -> dict:
        """Token-weighted mean loss over a split, on all ranks."""
        sums = []  # kept on the engine's device: no host synchronisation per batch
        for _, _, batch, padding in self._eval_batches(split):
            out = self.forward(batch)
            if not padding:
                loss_sum = torch.as_tensor(out["loss_sum"]).detach().double()
                sums.append(torch.stack([loss_sum, torch.as_tensor(out["num_tokens"], device=loss_sum.device).double()]))
        totals = comm.all_reduce(torch.stack(sums).sum(0) if sums else torch.zeros(2, dtype=torch.float64))
        return {"loss": (totals[0] / totals[1].clamp(min=1)).item(), "num_tokens": int(totals[1])}

    @torch.no_grad()
    def generate_split(self, split: str) -> list[dict]:
        """Generate an answer for every sample of a split; the full list on every rank, in index order.

        Each result: ``index``, ``dataset`` (its section), ``image``, ``prompt`` (the last instruction),
        ``references`` (every acceptable answer), ``expected`` (the first) and ``generated``.
        """
        kwargs = {"max_new_tokens": 30, "num_beams": 1, **dict(self.run.generate)}
        sections = [name for name, per_split in self.datasets.items() if split in per_split]  # _concat's order
        mine = []
        for dataset, indices, batch, padding in self._eval_batches(split):
            texts = self.generate(batch, **kwargs)
            if padding:
                continue
            references = batch.get("references") or [output[-1:] for output in batch["output"]]
            for index, text, instruction, refs in zip(indices, texts, batch["instruction"], references, strict=True):
                mine.append({"index": index, "dataset": sections[_part_of(dataset, index)[0]],
                             "image": _image_name(dataset, index), "prompt": instruction[-1],
                             "references": list(refs), "expected": refs[0], "generated": text})
        gathered = comm.all_gather_object(mine)
        return sorted((r for part in gathered for r in part), key=lambda r: r["index"])

    # -------------------------------------------------------------------- data
    def _concat(self, splits) -> torch.utils.data.Dataset:
        parts = [per_split[s] for per_split in self.datasets.values() for s in splits if s in per_split]
        if not parts:
            raise ValueError(f"no dataset has split(s) {list(splits)}")
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)

    def _loader(self, dataset, batch_sampler) -> DataLoader:
        first = dataset.dataset if isinstance(dataset, SeededDataset) else dataset
        first = first.datasets[0] if isinstance(first, ConcatDataset) else first
        # Workers leave SIGTERM/SIGINT to this process, which stops at a step boundary.
        # Pinned host memory on CUDA: the batch's copy to the GPU (non_blocking, common.precision) can then
        # overlap the step instead of waiting for a pageable-memory staging copy.
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=first.collater,
                          num_workers=self.run.num_workers, persistent_workers=False,
                          pin_memory=torch.cuda.is_available(),
                          worker_init_fn=faults.ignore_stop_signals if self.run.num_workers else None)


def _image_name(dataset, index: int) -> str | None:
    """The image file of a sample, for reports and predictions (None if the dataset cannot say)."""
    _, part, local = _part_of(dataset, index)
    image_of = getattr(part, "image_name", None)
    return image_of(local) if image_of else None


def _part_of(dataset, index: int) -> tuple[int, torch.utils.data.Dataset, int]:
    """(number of the part, the part, the index inside it) of a ConcatDataset's sample; (0, dataset, index) else."""
    if not isinstance(dataset, ConcatDataset):
        return 0, dataset, index
    d = bisect.bisect_right(dataset.cumulative_sizes, index)
    return d, dataset.datasets[d], index - (dataset.cumulative_sizes[d - 1] if d else 0)
