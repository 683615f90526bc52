"""The training loop every runner shares.

A runner subclass says how to wrap the model (``wrap``), accumulate the gradients
of a step (``forward_backward``) and apply them (``optimizer_step``), run a forward
pass (``forward``), and check, save and load a checkpoint. Everything else - data
order, LR schedule, hooks, resumption, what stops a run on every rank (signals,
failed loads, non-finite losses) - is here, once.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import json
import math
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import ConcatDataset, DataLoader

from lavis_ds.common import comm, dist
from lavis_ds.common.errors import ConfigError, LavisDsError, report
from lavis_ds.common.registry import registry
from lavis_ds.common.registry import runners as runner_registry
from lavis_ds.common.run_config import Twin, batch_sizes, elastic_batch_sizes
from lavis_ds.common.seeding import SeededDataset, derive_seed, seed_everything
from lavis_ds.datasets.lengths import approximate_length
from lavis_ds.datasets.mixing import mix_train_splits
from lavis_ds.datasets.samplers import EvalBatchSampler, StepBatchSampler
from lavis_ds.optim import build_param_groups
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners import faults, throughput
from lavis_ds.runners.hooks import build_hooks


@dataclass
class TrainState:
    """Where training is. Saved in every checkpoint; enough to continue exactly there."""

    epoch: int = 0
    global_step: int = 0  # optimizer steps done
    step_in_epoch: int = 0  # optimizer steps done in `epoch`


class RunnerBase:
    """Owns the loop; subclasses own the engine."""

    def __init__(self, cfg: DictConfig, model: torch.nn.Module, datasets: dict[str, dict]):
        self.cfg, self.run = cfg, cfg.run
        self.model, self.datasets = model, datasets
        self.rank, self.world_size = dist.rank(), dist.world_size()
        self.output_dir = Path(self.run.output_dir)
        self.resume_from = self.resume_source()
        self.micro_batch, self.accum, self.global_batch = self._batch_sizes()

        self.state = TrainState()
        self.saved_step: int | None = None  # the step of the newest checkpoint this run saved or resumed from
        self.train_set = None
        if self.run.train_splits:
            # sample_ratio on the sections: each epoch draws from them by ratio; else one concatenation.
            mixed = mix_train_splits(datasets, cfg.datasets, self.run.train_splits, self.run.seed)
            # Augmentation is a function of (seed, epoch, sample index): a resumed epoch repeats it exactly.
            self.train_set = SeededDataset(mixed or self._concat(self.run.train_splits), self.run.seed)
        if self.train_set is not None:
            length_of = functools.partial(approximate_length, self.train_set) if self.run.length_grouped else None
            self.sampler = StepBatchSampler(len(self.train_set), self.micro_batch, self.accum, self.world_size,
                                            self.rank, seed=self.run.seed, length_of=length_of)
            self.steps_per_epoch = self.sampler.steps_per_epoch
            self.train_loader = self._loader(self.train_set, self.sampler)
        else:
            self.steps_per_epoch = 0
        self.total_steps = self.steps_per_epoch * self.run.max_epoch

        param_groups = build_param_groups(model, self.run.weight_decay, dict(self.run.lr_scales))
        self.optimizer = self.wrap(model, param_groups)
        self.scheduler = registry.get_lr_scheduler_class(self.run.lr_sched).from_config(
            self.optimizer, self.run, total_steps=max(1, self.total_steps), steps_per_epoch=max(1, self.steps_per_epoch))
        self.hooks = build_hooks(self)

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        self.resume()
        if self.already_finished():
            return
        if self.rank == 0:  # from an earlier run in this folder (run.resume=false): not this run's
            self.finished_file.unlink(missing_ok=True)
        self.call_hooks("before_train")
        self.module.train()  # once: evaluation restores the mode it found
        with faults.SignalCatcher() as self.signals:
            try:
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
        if signum := faults.agree(self.signals.received, error):
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
        self.resume()
        self.call_hooks("before_train")
        try:
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

    def request_save(self, reason: str) -> None:
        """Ask for a checkpoint of this step, from a hook handling after_step, after_epoch or on_stop. A save is
        collective: every rank must ask (hooks decide from the step counters, which every rank shares)."""
        self.hooks.request_save(reason)

    # ------------------------------------------------- what subclasses provide
    # What this engine calls on a model beyond training, as keys of lavis_ds.models.base.CONTRACT (e.g. "shard").
    MODEL_NEEDS: tuple[str, ...] = ()
    OPTIONS_KEY: str | None = None  # this engine's own options section under `run:` (e.g. "fsdp")
    # Glob patterns of the files this engine writes into a checkpoint folder: how a folder is recognised as
    # a checkpoint before it is complete, and whose it is when its marker predates the `runner` field.
    CHECKPOINT_FILES: tuple[str, ...] = ()

    @classmethod
    def read_options(cls, value: Any) -> tuple[dict | None, list[str]]:
        """This runner's options section as the YAML gives it, as a mapping (None if unusable), and problems.
        Read for every run that has the section, whichever runner it chose. Default: a mapping, or nothing."""
        if value is None:
            return {}, []
        if isinstance(value, dict):
            return value, []
        return None, [f"run.{cls.OPTIONS_KEY}: expected a mapping of {cls.__name__}'s options, got {value!r}"]

    @classmethod
    def option_twins(cls, options: dict) -> tuple[list[Twin], list[str]]:
        """The engine-neutral run keys (``run_config.NEUTRAL_KEYS``) that this runner's options section sets
        in its engine's own words, and problems with those values. The config loader maps them onto the run
        keys whichever runner the run chose, so switching ``run.runner`` keeps the batch, precision, ...
        Default: none."""
        return [], []

    @classmethod
    def config_problems(cls, run: dict, world_size: int, settings_ok: bool) -> list[str]:
        """Problems of this engine's own options section of ``run`` (plain dict, its neutral keys resolved;
        ``settings_ok``: they are valid). Default: none."""
        return []

    @classmethod
    def complete_config(cls, run: dict, world_size: int) -> tuple[dict, list[str]]:
        """``run`` (valid) with this engine's section completed as the engine will use it, and notes for the log."""
        return run, []

    @classmethod
    def prepare_process(cls, cfg: DictConfig) -> None:
        """Once per process, before the process group starts (e.g. compile the engine's ops). Default: nothing."""

    @classmethod
    def model_placement(cls, cfg: DictConfig) -> contextlib.AbstractContextManager:
        """The context the model is built in (after the process group starts): where the LLM's weights go
        while it is built, e.g. partitioned from the start (``lavis_ds.models.llm_placement``). Default:
        whole, on every process."""
        return contextlib.nullcontext()

    @classmethod
    def init_process_group(cls) -> None:
        """Start torch.distributed for this process (after ``prepare_process``)."""
        dist.init_distributed()

    def wrap(self, model: torch.nn.Module, param_groups: list[dict]):
        """Build the engine around ``model``; return the optimizer whose param_groups carry the lr."""
        raise NotImplementedError

    def forward(self, batch: dict) -> dict:
        raise NotImplementedError

    def checkpoint_layout(self) -> dict:
        """What the completion marker records about how the engine cut the checkpoint (runner, stage, dtype)."""
        return {}

    def forward_backward(self, micro_batches: list[dict]) -> torch.Tensor:
        """Forward and backward every micro-batch, accumulating gradients; return this rank's losses (float64, CPU)."""
        raise NotImplementedError

    def optimizer_step(self, apply: bool = True) -> dict:
        """Finish the optimizer step (``apply=False``: drop the gradients, change no weight); return its grad_norm
        and, if the engine skipped it on its own (fp16 loss-scale overflow), ``skipped``."""
        raise NotImplementedError

    def check_checkpoint(self, tag_dir: Path, same_world: bool) -> None:
        """Raise a CheckpointError if this rank cannot resume from ``tag_dir`` (files, trained set, engine layout)."""

    def save_checkpoint(self, tag: str, client_state: dict) -> None:
        raise NotImplementedError

    def load_checkpoint(self, load_dir: Path, tag: str | None) -> dict:
        """Load engine state; return the client state saved with it."""
        raise NotImplementedError

    @property
    def module(self) -> torch.nn.Module:
        """The model without its wrapper (for generate and export)."""
        return self.model

    @classmethod
    def read_trained_weights(cls, tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """``(trained fp32 weights by parameter name, client state, layout)`` of a complete checkpoint this runner
        wrote, read in one process (for export); layout: ``precision`` and engine details (e.g. ``zero_stage``)."""
        raise ckpt.CheckpointError(f"{tag_dir}: {cls.__name__} checkpoints cannot be exported")

    # ------------------------------------ switching engines: what a runner provides
    # A checkpoint written by another runner continues here when both engines keep AdamW's state per
    # parameter in fp32: the runner that wrote it reads it out (handover_shapes, read_handover), this one
    # says whether it can take it exactly (takeover_problem) and loads it (in its load_checkpoint).
    @classmethod
    def handover_shapes(cls, tag_dir: Path, rank: int) -> dict[str, tuple]:
        """For another runner resuming ``tag_dir``, which this runner wrote: the trained parameters' names and
        shapes, or a CheckpointError if the checkpoint cannot carry over exactly. Default: it cannot."""
        raise ckpt.CheckpointError(f"{tag_dir} was written by {cls.__name__}, whose checkpoints do not carry over "
                                   f"to another engine")

    @classmethod
    def read_handover(cls, tag_dir: Path, scratch: Path, rank: int, needed: bool = True) -> ckpt.Handover | None:
        """The trained state of ``tag_dir`` (which this runner wrote) for another runner. Collective: every rank
        calls it; ``needed``: whether this rank uses the result (None may come back if not); ``scratch``: a
        folder for temporary files, removed again. A runner that overrides ``handover_shapes`` overrides this too."""
        raise NotImplementedError(f"{cls.__name__} hands its checkpoints over (handover_shapes) but does not "
                                  "read them out: define read_handover")

    def takeover_problem(self) -> str | None:
        """Why this run cannot continue another engine's checkpoint exactly (None: it can). Default: it cannot."""
        return f"{type(self).__name__} does not continue other engines' checkpoints"

    # ------------------------------------------------ switching engines: the shared part
    @property
    def name(self) -> str:
        """The registered name of this runner (``run.runner`` without its alias)."""
        return runner_registry.canonical(self.run.runner)

    def foreign_writer(self, tag_dir: Path) -> type[RunnerBase] | None:
        """The runner class that wrote ``tag_dir`` if it is another engine's (None: this runner's own)."""
        writer = ckpt.writer_of(tag_dir)  # whole, or DamagedCheckpoint
        if writer not in runner_registry:
            raise ckpt.CheckpointError(f"{tag_dir} was written by {writer}, which is not a registered runner here "
                                       f"(known: {', '.join(runner_registry)}); list its module under `imports:`")
        source = registry.get_runner_class(writer)
        return None if isinstance(self, source) else source

    def check_takeover(self, tag_dir: Path, source: type[RunnerBase]) -> None:
        """A CheckpointError unless ``tag_dir``, written by ``source``, continues here exactly: the writer's
        side (its engine layout), this run's side, and the trained parameters."""
        writer = ckpt.writer_of(tag_dir)
        problem = self.takeover_problem()
        if problem:
            raise ckpt.CheckpointError(
                f"{tag_dir} was written by {writer}, and {self.name} {problem}. Resume with run.runner: {writer}, "
                f"or start afresh (--options run.resume=false, or another run.output_dir)")
        saved = source.handover_shapes(tag_dir, self.rank)
        problems = ckpt.trainable_problems(tag_dir, saved, self.model)
        if problems:
            raise ckpt.CheckpointError(f"{tag_dir} does not fit this model: " + "; ".join(problems))

    def report_takeover(self, tag_dir: Path) -> None:
        if self.rank == 0:
            print(f"resumed {ckpt.writer_of(tag_dir)}'s checkpoint {tag_dir} under {self.name} (fp32 weights and "
                  f"AdamW moments carried over parameter by parameter)", flush=True)

    def trainable_names(self) -> list[str]:
        return [name for name, p in self.module.named_parameters() if p.requires_grad]

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

    def resume_source(self) -> tuple[Path, str | None] | None:
        """(load_dir, tag) to resume from, following run.resume / resume_ckpt_load_dir.

        Every rank checks the files it will read, and all agree on the result: with
        `run.resume: auto`, a damaged checkpoint is set aside (renamed, never deleted) and
        the previous complete one is taken; a checkpoint named explicitly must be whole.
        """
        candidates, explicit, what = self._resume_candidates()
        for tag_dir in candidates:
            problem = None
            try:
                self.check_checkpoint(tag_dir, same_world=self._saved_world(tag_dir) == self.world_size)
            except ckpt.CheckpointError as e:
                problem = (str(e), isinstance(e, ckpt.DamagedCheckpoint))
            problems = [p for p in comm.all_gather_object(problem) if p is not None]
            if not problems:
                return tag_dir.parent, tag_dir.name
            message, damaged = problems[0]
            if not damaged or explicit:
                error = (ckpt.DamagedCheckpoint if damaged else ckpt.CheckpointError)(
                    f"{what}: {message}" + ("; name another checkpoint, or pass run.resume=auto to take the newest "
                                            "readable one" if damaged else ""))
                error.quiet = self.rank != 0  # every rank knows the same problem; one prints it
                raise error
            if self.rank == 0:
                kept = ckpt.set_aside(tag_dir)
                report(f"{message}; the checkpoint is set aside as {kept} (not deleted) and the previous complete "
                       "checkpoint is used instead")
            comm.barrier()
        if explicit or candidates:
            error = ckpt.CheckpointError(f"{what}: no readable complete checkpoint (the damaged ones were set aside); "
                                         "pass run.resume=false or a new run.output_dir to start over")
            error.quiet = self.rank != 0
            raise error
        return None

    def _resume_candidates(self) -> tuple[list[Path], bool, str]:
        """(complete checkpoints to try in order, whether the user named exactly one, the setting that named them)."""
        if self.run.resume_ckpt_load_dir:
            load_dir, tag = Path(self.run.resume_ckpt_load_dir), self.run.resume_ckpt_tag
            what = f"run.resume_ckpt_load_dir={load_dir}" + (f", run.resume_ckpt_tag={tag}" if tag else "")
            if tag is None:
                return ckpt.complete_checkpoints(load_dir) or [self._complete_or_error(load_dir, what)], False, what
            return [self._complete_or_error(load_dir / tag, what)], True, what
        resume = self.run.resume
        if resume in (False, None):
            return [], False, "run.resume"
        if resume == "auto":
            return ckpt.complete_checkpoints(self.checkpoint_dir), False, "run.resume=auto"
        path, what = Path(resume), f"run.resume={resume}"
        if ckpt.is_complete(path):
            return [path], True, what
        found = ckpt.complete_checkpoints(path)
        if not found:
            self._complete_or_error(path, what)
        return found, False, what

    @staticmethod
    def _complete_or_error(path: Path, what: str) -> Path:
        if ckpt.is_complete(path):
            return path
        newest = ckpt.latest_complete(path.parent) if path.parent.is_dir() else None
        if not path.exists():
            state = "does not exist"
        elif ckpt.looks_like_checkpoint(path):
            state = f"is an incomplete checkpoint (no {ckpt.COMPLETE_MARKER}: a save that did not finish)"
        else:
            state = "is not a checkpoint folder"
        raise ckpt.CheckpointError(
            f"{what}: {path} {state}; it holds no complete lavis_ds checkpoint (a step_<N> folder with "
            f"{ckpt.COMPLETE_MARKER}); " + (f"the newest complete one beside it is {newest}" if newest else
                                            "name a complete checkpoint, or use run.resume=auto"))

    def _saved_world(self, tag_dir: Path) -> int | None:
        try:
            return ckpt.read_marker(tag_dir).get("world_size")
        except ckpt.DamagedCheckpoint:
            return None  # check_checkpoint reports it

    def _batch_sizes(self) -> tuple[int, int, int]:
        """The config's batch sizes; resuming on another number of processes keeps the saved global batch."""
        micro, accum, total = batch_sizes(OmegaConf.to_container(self.run), self.world_size)
        saved = self.saved_layout()
        self.elastic = saved is not None and saved["world_size"] != self.world_size
        if not self.elastic:
            return micro, accum, total
        where = f"resuming {self.resume_from[0] / self.resume_from[1]} (saved by {saved['world_size']} processes)"
        try:
            return elastic_batch_sizes(micro, saved["global_batch"], self.world_size, where)
        except ValueError as e:
            raise ConfigError([str(e)], str(self.resume_from[0])) from None

    def saved_layout(self) -> dict | None:
        """World size and global batch of the checkpoint to resume from (None: fresh start or unknown)."""
        if self.resume_from is None:
            return None
        info = ckpt.read_marker(self.resume_from[0] / self.resume_from[1])
        return info if "world_size" in info else None

    def resume(self) -> None:
        source = self.resume_from
        if source is None:
            seed_everything(self.run.seed + self.rank)
            return
        load_dir, tag = source
        if self.rank == 0:
            # A save the kill interrupted: its steps come again, and its folder must not hold stale files.
            for torn in ckpt.discard_incomplete(self.checkpoint_dir):
                print(f"discarded the incomplete checkpoint {torn}", flush=True)
        comm.barrier()
        client = self.load_checkpoint(load_dir, tag)["lavis_ds"]
        self.state = TrainState(**client["train_state"])
        self.saved_step = self.state.global_step
        self.scheduler.load_state_dict(client["scheduler"])
        rng = ckpt.rng_file(load_dir / tag, self.rank)
        if client.get("world_size") == self.world_size and rng.is_file():
            ckpt.restore_rng_states(ckpt.load_file(rng))
        else:
            seed_everything(self.run.seed + self.rank + self.state.global_step)
        if self.rank == 0:
            print(f"resumed from {load_dir / tag} at epoch {self.state.epoch}, "
                  f"step {self.state.global_step} ({self.state.step_in_epoch} into the epoch), "
                  f"lr {self.scheduler.get_lr():.3e}", flush=True)

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

    def generate(self, batch: dict, **kwargs) -> list[str]:
        raise NotImplementedError

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
