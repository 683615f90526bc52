"""What an engine is to the trainer: it wraps the model, runs forward/backward and the optimizer step, and checks,
saves and loads checkpoints. ``runners/trainer.py`` (the loop) holds one; each engine package defines one,
registered in ``registry.engines`` (``run.runner`` names it).

An engine class holds three parts as class attributes, each with one job, all used before (or without) any
engine instance:

- ``config`` (an ``EngineConfig``): the engine's own options section under ``run:`` as the config loader reads,
  checks and completes it, for every run that has the section, whichever engine it chose, and what the config
  check asks of the engine (whether it runs every objective, what it calls on a model);
- ``checkpoints`` (an ``EngineCheckpoints``): its checkpoint files read in one process with no engine built:
  which files are its, the trained weights (for export), and its per-parameter state for another engine
  continuing the run (``runners/handover.py`` is the shared part of switching engines);
- ``setup`` (an ``EngineSetup``): how a process starts (``prepare_process``, ``init_process_group``) and where the
  model is built (``model_placement``): ``train.py`` and ``build.py`` call it before any trainer exists.

The engine class itself does the instance work. An engine is built
with plain assignments (no disk, no collective); the trainer decides which checkpoint to resume and the batch
layout first (``resume_plan.ResumePlan``, for which it asks the engine to ``check_checkpoint``), then hands that plan
to ``wrap``.
"""
from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from omegaconf import DictConfig

from lavis_ds.common import dist
from lavis_ds.common.run_config import Twin
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.resume_plan import ResumePlan


class Forwarded(NamedTuple):
    """What ``Engine.forward_backward`` returns: every forward done, the last backward still to run."""

    losses: torch.Tensor  # this rank's loss of each micro-batch (float64, on the engine's device)
    # The last micro-batch's backward. The loop runs it once it has started the step's loss check, whose
    # all-reduce then travels while the backward computes.
    last_backward: Callable[[], Any]


def micro_batch_loss(out: dict, loss_weight: dict[str, float] | None) -> torch.Tensor:
    """The loss an engine backpropagates for one micro-batch (the model's output): each of its summed loss terms
    (``loss_sums`` per unit, as an objective returns them; a model's next-token ``loss_sum`` is the ``tokens``
    term) times the step's weight of its unit (``losses.step_loss_weights``), or, without weights, the model's own
    per-micro-batch mean. Engines average these over micro-batches and ranks."""
    if loss_weight is None:
        return out["loss"]
    sums = out.get("loss_sums") or {"tokens": out["loss_sum"]}
    return sum(value * loss_weight[unit] for unit, value in sums.items())


class EngineConfig:
    """An engine's options section under ``run:`` (``KEY``), as the config loader reads it. Default: none."""

    KEY: str | None = None  # the section's key under `run:` (e.g. "fsdp")
    # The shared loop prepares and weights each micro-batch as the objective (run.task) says, and a batch that names
    # its objective is scored by it inside the model's forward: an engine that backpropagates micro_batch_loss of
    # its forward runs every objective. One that computes a loss of its own sets False (pairwise tasks refused).
    RUNS_OBJECTIVES = True
    # What this engine calls on a model beyond training, as keys of lavis_ds.models.base.CONTRACT (e.g. "shard").
    MODEL_NEEDS: tuple[str, ...] = ()
    # `run` keys that this engine alone reads (DeepSpeed's ZeRO stage): under another engine a log line names them
    OWN_RUN_KEYS: tuple[str, ...] = ()

    @classmethod
    def read(cls, value: Any) -> tuple[dict | None, list[str]]:
        """The section as the YAML gives it, as a mapping (None if unusable), and problems. Read for every run that
        has the section, whichever engine it chose. Default: a mapping, or nothing."""
        if value is None:
            return {}, []
        if isinstance(value, dict):
            return value, []
        return None, [f"run.{cls.KEY}: expected a mapping of this engine's options, got {value!r}"]

    @classmethod
    def twins(cls, options: dict) -> tuple[list[Twin], list[str]]:
        """The engine-neutral run keys (``run_config.NEUTRAL_KEYS``) and this engine's own run keys
        (``OWN_RUN_KEYS``) that the section ``options`` sets in its engine's own words, and problems with those
        values. The config loader maps them onto the run keys
        whichever engine the run chose, so switching ``run.runner`` keeps the batch, precision, ... Default: none."""
        return [], []

    @classmethod
    def problems(cls, run: dict, world_size: int, settings_ok: bool) -> list[str]:
        """Problems of the section in ``run`` (plain dict, its neutral keys resolved; ``settings_ok``: they are
        valid), for the run's engine. Default: none."""
        return []

    @classmethod
    def model_problems(cls, run: dict, model: dict) -> list[str]:
        """What this engine cannot run of the ``model`` section with these ``run`` settings (plain dicts, neutral
        keys resolved). Default: none."""
        return []

    @classmethod
    def complete(cls, run: dict, world_size: int) -> tuple[dict, list[str]]:
        """``run`` (valid) with the section completed as the engine will use it, and notes for the log."""
        return run, []


class EngineCheckpoints:
    """An engine's checkpoint folders read in one process, without an engine (export, another engine resuming)."""

    # Glob patterns of the files this engine writes into a checkpoint folder: how a folder is recognised as
    # a checkpoint before it is complete, and whose it is when its marker predates the `runner` field.
    FILES: tuple[str, ...] = ()

    @classmethod
    def read_trained_weights(cls, tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
        """``(trained fp32 weights by parameter name, client state, layout)`` of a complete checkpoint, read in one
        process (for export); layout: ``precision`` and engine details (e.g. ``zero_stage``)."""
        raise ckpt.CheckpointError(f"{tag_dir}: {ckpt.writer_of(tag_dir)} checkpoints cannot be exported")

    # A checkpoint continues under another engine when both keep AdamW's state per parameter in fp32: its
    # writer's part reads it out (handover_shapes, read_handover); the engine continuing it says whether it can
    # take it exactly (Engine.takeover_problem) and loads it in its load_checkpoint.
    @classmethod
    def handover_shapes(cls, tag_dir: Path, rank: int) -> dict[str, tuple]:
        """For another engine resuming ``tag_dir``: the trained parameters' names and shapes, or a CheckpointError
        if the checkpoint cannot carry over exactly. Default: it cannot."""
        raise ckpt.CheckpointError(f"{tag_dir} was written by {ckpt.writer_of(tag_dir)}, whose checkpoints do not "
                                   f"carry over to another engine")

    @classmethod
    def read_handover(cls, tag_dir: Path, scratch: Path, rank: int, needed: bool = True) -> ckpt.Handover | None:
        """The trained state of ``tag_dir`` for another engine. Collective: every rank calls it; ``needed``: whether
        this rank uses the result (None may come back if not); ``scratch``: a folder for temporary files, removed
        again. A part that overrides ``handover_shapes`` overrides this too."""
        raise NotImplementedError(f"{cls.__name__} hands its checkpoints over (handover_shapes) but does not "
                                  "read them out: define read_handover")


class EngineSetup:
    """How an engine's processes start, before any engine exists (``train.py`` and ``build.py`` call it)."""

    @classmethod
    def prepare_process(cls, cfg: DictConfig) -> None:
        """Once per process, before the process group starts (e.g. compile the engine's ops). Default: nothing."""

    @classmethod
    def init_process_group(cls) -> None:
        """Start torch.distributed for this process (after ``prepare_process``)."""
        dist.init_distributed()

    @classmethod
    def model_placement(cls, cfg: DictConfig) -> contextlib.AbstractContextManager:
        """The context the model is built in (after the process group starts): where the LLM's weights go
        while it is built, e.g. partitioned from the start (``lavis_ds.models.llm_placement``). Default:
        whole, on every process."""
        return contextlib.nullcontext()


class Engine:
    """The engine interface: an engine class overrides what it needs; the defaults say what is optional."""

    config: type[EngineConfig] = EngineConfig  # its options section under `run:`, what it runs and needs
    checkpoints: type[EngineCheckpoints] = EngineCheckpoints  # its checkpoint folders, read without an engine
    setup: type[EngineSetup] = EngineSetup  # how its processes start and where the model is built

    def __init_subclass__(cls, **kwargs):
        """An engine whose ``forward_backward`` takes more than the micro-batches and their loss weights (a loop
        callback) is named when its module is imported (under `imports:` the config check reports it), not by a
        TypeError at the first step."""
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get("forward_backward")
        if method is None:  # inherited: checked where it is defined
            return
        signature = inspect.signature(method)
        params = signature.parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) != 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__}.forward_backward{signature} must be "
                "forward_backward(self, micro_batches, loss_weight): every forward and every backward but the last, "
                "returning Forwarded(losses, last_backward); the loop runs last_backward after starting its loss "
                "check (lavis_ds/runners/engine.py; tests/ddp_engine.py is an example)")

    def __init__(self, run: DictConfig, model: torch.nn.Module, checkpoint_dir: Path):
        """Plain assignments: ``wrap`` builds the engine, once the trainer has planned the resume."""
        self.run, self.model, self.checkpoint_dir = run, model, Path(checkpoint_dir)
        self.rank, self.world_size = dist.rank(), dist.world_size()
        self.plan: ResumePlan | None = None  # wrap's: the checkpoint to continue and the batch layout
        self.optimizer = None  # wrap's: the optimizer whose param_groups carry the lr

    def wrap(self, param_groups: list[dict], plan: ResumePlan):
        """Build the engine around the model for ``plan`` (the checkpoint it will load, the batch layout); return the
        optimizer whose param_groups carry the lr."""
        raise NotImplementedError

    def forward(self, batch: dict) -> dict:
        raise NotImplementedError

    def generate(self, batch: dict, **kwargs) -> list[str]:
        """The text generated for every sample of ``batch``; every rank calls it (sharded engines gather)."""
        raise NotImplementedError

    def checkpoint_layout(self) -> dict:
        """What the completion marker records about how the engine cut it (`runner`: its name, stage, dtype)."""
        return {}

    def forward_backward(self, micro_batches: list[dict], loss_weight: dict[str, float] | None) -> Forwarded:
        """Forward every micro-batch (its loss: ``micro_batch_loss(out, loss_weight)``) and backward every one but
        the last, accumulating gradients; return this rank's losses (float64, on the device) and the last
        micro-batch's backward, not yet run (``Forwarded``). The loop starts its loss check between the two, so that
        the check's all-reduce runs while the last backward does."""
        raise NotImplementedError

    def optimizer_step(self, apply: bool = True) -> dict:
        """Finish the optimizer step (``apply=False``: drop the gradients, change no weight); return its grad_norm
        and, if the engine skipped it on its own (fp16 loss-scale overflow), ``skipped``."""
        raise NotImplementedError

    def check_checkpoint(self, tag_dir: Path, same_world: bool) -> None:
        """Raise a CheckpointError if this rank cannot resume from ``tag_dir`` (files, trained set, engine layout).
        Called before ``wrap`` (the checkpoint decides how to wrap): it reads the model and the run, not the engine."""

    def save_checkpoint(self, tag: str, client_state: dict) -> None:
        raise NotImplementedError

    def load_checkpoint(self, load_dir: Path, tag: str) -> dict:
        """Load engine state (after ``wrap``); return the client state saved with it."""
        raise NotImplementedError

    @property
    def module(self) -> torch.nn.Module:
        """The model without its wrapper (for generate and export)."""
        return self.model

    # Switching engines: another engine's checkpoint continues here when this says the run can take it exactly;
    # the writer's ``checkpoints`` part reads it out, and this engine loads it in its ``load_checkpoint``.
    def takeover_problem(self) -> str | None:
        """Why this run cannot continue another engine's checkpoint exactly (None: it can). Default: it cannot."""
        return f"{type(self).__name__} does not continue other engines' checkpoints"
