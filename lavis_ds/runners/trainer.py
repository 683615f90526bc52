"""The training loop every engine shares, and what surrounds it: setting up, saving, dispatching to hooks.

A ``Trainer`` holds its parts: the engine (``runners/engine.py``: wrap, forward/backward, optimizer step,
checkpoint files; one per engine package, ``run.runner`` names it), the training data (``runners/data.py``)
the hooks (``runners/hooks``: logging, evaluation, when to save) and the ranks' agreement to take each step
(``runners/agreement.py``). Data order, LR schedule, hooks and what stops a run on every rank (signals, failed
loads, non-finite losses: ``faults``, ``losses``) are here, once;
which checkpoint a run continues is ``runners/resume.py``, and continuing another engine's checkpoint
``runners/handover.py``.

Building a trainer touches neither the disk nor the other processes: ``setup`` (the first thing ``train`` and
``evaluate_only`` do) plans the resume (the checkpoint and the batch layout, ``resume.ResumePlan``), then builds
what depends on it - data order, the wrapped engine, LR schedule, hooks - and restores the checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from lavis_ds.common import comm
from lavis_ds.common import registry as reg
from lavis_ds.common.seeding import derive_seed, seed_everything
from lavis_ds.optim import build_param_groups
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners import faults, throughput
from lavis_ds.runners.agreement import StepAgreement
from lavis_ds.runners.data import TrainData
from lavis_ds.runners.engine import Engine
from lavis_ds.runners.hooks import HookList, build_hooks
from lavis_ds.runners.losses import LossCheck
from lavis_ds.runners.resume import TrainState, plan_resume, restore
from lavis_ds.runners.resume_plan import ResumePlan

# Events every rank dispatches together, after which the ranks agree on a failure one of them deferred (after_step
# leaves it to the next step's agreement, which every step makes anyway).
AGREED_EVENTS = ("before_train", "after_epoch", "after_train", "evaluate")


class Trainer:
    """The loop; it holds an engine, the training data and the hooks."""

    def __init__(self, cfg: DictConfig, engine: Engine, data: TrainData):
        """Plain assignments (no disk, no collectives): ``setup`` does the rest, once every rank is here."""
        self.cfg, self.run = cfg, cfg.run
        self.engine, self.data = engine, data
        self.rank, self.world_size = engine.rank, engine.world_size
        self.output_dir = Path(self.run.output_dir)
        self.state = TrainState()
        self.saved_step: int | None = None  # the step of the newest checkpoint this run saved or resumed from
        self.plan: ResumePlan | None = None  # setup()'s: the checkpoint to continue and the batch layout
        self.optimizer, self.scheduler = None, None  # setup()'s
        self.hooks = HookList(self, [])  # setup()'s: build_hooks(self)
        self.agreement = StepAgreement()  # its signal catcher listens while train() runs

    @classmethod
    def from_config(cls, cfg: DictConfig, model: torch.nn.Module, datasets: dict[str, dict]) -> Trainer:
        """The trainer of a config: the engine ``run.runner`` names, around ``model``; ``datasets`` to train on."""
        engine = reg.engines.get(cfg.run.runner)(cfg.run, model, Path(cfg.run.output_dir) / "checkpoints")
        return cls(cfg, engine, TrainData(cfg, model, datasets, engine.rank, engine.world_size))

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    @property
    def total_steps(self) -> int:
        return self.data.steps_per_epoch * self.run.max_epoch

    def setup(self) -> None:
        """The resume plan, then what depends on it: data order, the wrapped engine, schedule, hooks; then the
        checkpoint is loaded (or a fresh start seeded).

        Collective (every rank checks the checkpoint's files, and the engine's start may be), and it may set a
        damaged checkpoint aside (``run.resume: auto``). ``train`` and ``evaluate_only`` call it; a caller that
        steps the trainer itself (a benchmark) calls it first. Once: a second call does nothing.
        """
        if self.plan is not None:
            return
        plan = plan_resume(self.engine, self.run, self.checkpoint_dir)
        self.data.build(plan.micro_batch, plan.accum)
        groups = build_param_groups(self.engine.model, self.run.weight_decay, dict(self.run.lr_scales))
        self.data.objective.setup(self.engine.model)  # the starting weights, before the engine shards them
        self.optimizer = self.engine.wrap(groups, plan)
        self.data.objective.before_train(self, resuming=plan.source is not None)  # e.g. DPO's reference pass
        self.scheduler = reg.lr_schedulers.get(self.run.lr_sched).from_config(
            self.optimizer, self.run, total_steps=max(1, self.total_steps),
            steps_per_epoch=max(1, self.data.steps_per_epoch))
        self.hooks = build_hooks(self)
        self.plan = plan
        self.state = restore(self.engine, plan, self.scheduler, self.run, self.checkpoint_dir)
        self.saved_step = self.state.global_step if plan.source is not None else None

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        self.setup()
        if _already_finished(self):
            return
        if self.rank == 0:  # from an earlier run in this folder (run.resume=false): not this run's
            _finished_file(self).unlink(missing_ok=True)
        with self.agreement.signals:
            try:
                self.call_hooks("before_train")  # inside the try: a hook that fails here still closes the others
                self.engine.module.train()  # once: evaluation restores the mode it found
                for epoch in range(self.state.epoch, self.run.max_epoch):
                    for micro_batches, load_following in self.data.steps(epoch, self.state.step_in_epoch):
                        self.run_step(micro_batches, load_following)
                    self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
                    self.call_hooks("after_epoch")
                self.call_hooks("after_train")
            finally:
                self.close()
        if self.rank == 0:  # last: a run killed during its final evaluation evaluates again when rerun
            _finished_file(self).write_text(json.dumps({"global_step": self.state.global_step}))

    def run_step(self, micro_batches: list[dict], load_following: Callable[[], list[dict]] | None = None) -> None:
        """One optimizer step on this rank's prepared micro-batches, once every rank agreed to take it: its lr,
        the counters, the hooks. ``load_following`` loads the next step's micro-batches (the loop passes it while
        the epoch has one): they are loaded during this step, and every rank's agreement to take that step rides
        on this step's loss check (``agreement``): one collective per step."""
        loss_weight, counts = self.agreement.for_step(self, micro_batches)
        tokens, lr = throughput.count_tokens(micro_batches), self.scheduler.get_lr()
        # Dropout & co. draw from (seed, step, rank): a resumed step draws what the original one did.
        seed_everything(derive_seed(self.run.seed, self.state.global_step, self.rank))
        # every forward, and every backward but the last: the losses are known, the gradients not yet complete
        losses, last_backward = self.engine.forward_backward(micro_batches, loss_weight)
        following = load_following() if load_following else None
        ahead = self.agreement.ahead(self, following) if following is not None else None
        # The loss check's all-reduce (the losses, the objective's metrics, the next step's agreement) travels
        # while the last backward computes; the update waits for its answer.
        check = LossCheck(losses, self.data.objective.take_metric_sums(), ahead)
        last_backward()
        metrics, totals = check.finish(self, counts)  # a non-finite loss stops the run here, or skips the update
        metrics.update(self.engine.optimizer_step(apply="skipped" not in metrics))
        self.scheduler.step()  # once per optimizer step, never per micro-batch
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        self.call_hooks("after_step", {**metrics, "lr": lr, "tokens": tokens})
        if totals is not None:  # after the hooks: a stop or a failure lands between this step and the next
            self.agreement.settle(self, totals)

    def evaluate_only(self) -> None:
        """`run.evaluate: true`: load the checkpoint named by `run.resume`, evaluate it, stop."""
        self.setup()
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

    def save(self) -> Path:
        """Save on every rank (DeepSpeed requires it), then mark the folder complete."""
        tag = ckpt.tag_for(self.state.global_step)
        client_state = {"lavis_ds": {"train_state": asdict(self.state), "scheduler": self.scheduler.state_dict(),
                                     "world_size": self.world_size, "config": OmegaConf.to_yaml(self.cfg)}}
        tag_dir, error = self.checkpoint_dir / tag, None
        try:
            self.engine.save_checkpoint(tag, client_state)
            torch.save(ckpt.rng_states(), ckpt.rng_file(tag_dir, self.rank))
        except (OSError, RuntimeError) as e:  # a full or failing disk (torch.save says RuntimeError): every rank
            error = ckpt.save_failure(e, tag_dir)  # stops, the previous checkpoint stays the newest
            if error is None:
                raise
        faults.agree(0, error)  # also the barrier: every rank has written everything before the marker says so
        if self.rank == 0:
            try:
                ckpt.mark_complete(tag_dir, {
                    "global_step": self.state.global_step, "epoch": self.state.epoch, "world_size": self.world_size,
                    "global_batch": self.plan.global_batch, **self.engine.checkpoint_layout()})
            except OSError as e:
                error = ckpt.save_failure(e, tag_dir)
        faults.agree(0, error)  # the marker too may meet a full disk
        self.call_hooks("after_save", tag_dir)  # scoring and pruning (BestCheckpoint)
        comm.barrier()
        self.saved_step = self.state.global_step
        return tag_dir


def _finished_file(trainer: Trainer) -> Path:
    return trainer.output_dir / "finished.json"


def _already_finished(trainer: Trainer) -> bool:
    """Whether this is a rerun of a run that completed, final evaluation included; says so if it is."""
    state, finished = trainer.state, _finished_file(trainer)
    done = (state.global_step >= trainer.total_steps and finished.is_file()
            and json.loads(finished.read_text()).get("global_step") == state.global_step)
    if done and trainer.rank == 0:
        print(f"lavis_ds: this run already finished at step {state.global_step} (results in "
              f"{trainer.output_dir / 'metrics.jsonl'}); nothing to do. To train longer raise run.max_epoch; "
              "to start over pass --options run.resume=false or use another run.output_dir.", flush=True)
    return done

