"""The `run:` section: its keys, their defaults, and the DeepSpeed JSON derived from it."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

# LAVIS / MiniGPT4Qwen keys that a DeepSpeed run does not need; accepted so old YAMLs load.
LEGACY_RUN_KEYS = ("task", "device", "world_size", "dist_url", "distributed", "amp", "iters_per_epoch",
                   "accum_grad_iters")


@dataclass
class RunConfig:
    """Schema of `run:`. Field names are the YAML keys; see README "Config keys"."""

    output_dir: str
    runner: str = "runner_deepspeed"
    lr_sched: str = "linear_warmup_cosine_lr"
    init_lr: float = 1e-4
    min_lr: float = 0.0
    warmup_lr: float = 0.0
    warmup_steps: int = 0
    warmup_ratio: float | None = None  # overrides warmup_steps: fraction of all optimizer steps
    lr_decay_rate: float = 0.1  # linear_warmup_step_lr: factor per epoch
    weight_decay: float = 0.05
    lr_scales: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> lr factor
    max_epoch: int = 1
    batch_size_train: int | None = None  # micro-batch per process (= train_micro_batch_size_per_gpu)
    batch_size_eval: int = 8
    num_workers: int = 0
    seed: int = 42
    log_freq: int = 10  # optimizer steps
    save_freq_steps: int = 0  # optimizer steps; 0 = only at epoch ends
    keep_last: int = 0  # newest complete checkpoints to keep, plus the best by validation loss; 0 = all
    resume: Any = "auto"  # "auto" | false | path to a checkpoint
    resume_ckpt_load_dir: str | None = None  # MiniGPT4Qwen spelling of `resume`
    resume_ckpt_tag: str | None = None
    evaluate: bool = False  # evaluate only, no training
    train_splits: list[str] = field(default_factory=lambda: ["train"])
    valid_splits: list[str] = field(default_factory=list)
    test_splits: list[str] = field(default_factory=list)
    generate: dict[str, Any] = field(default_factory=dict)  # kwargs of model.generate for test splits
    num_log_samples: int = 5  # generated samples written to metrics.jsonl per test split
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss: stop the run, or skip that optimizer step
    deepspeed_config: dict[str, Any] = field(default_factory=dict)


def batch_sizes(run: dict, world_size: int) -> tuple[int, int, int]:
    """(micro, accumulation, global) batch sizes, or ValueError saying which disagree."""
    ds = run.get("deepspeed_config") or {}
    micro = ds.get("train_micro_batch_size_per_gpu")
    legacy = run.get("batch_size_train")
    if micro is not None and legacy is not None and micro != legacy:
        raise ValueError(
            f"run.batch_size_train={legacy} and run.deepspeed_config.train_micro_batch_size_per_gpu={micro} "
            "disagree; they are the same setting, give one")
    micro = micro if micro is not None else legacy
    if micro is None:
        raise ValueError("run.deepspeed_config.train_micro_batch_size_per_gpu (or run.batch_size_train) is required")
    accum = ds.get("gradient_accumulation_steps")
    given = ds.get("train_batch_size")
    if accum is None and given is not None:  # as DeepSpeed does: the global batch fixes the accumulation
        return elastic_batch_sizes(micro, given, world_size, "run.deepspeed_config.train_batch_size")
    accum = 1 if accum is None else accum
    total = micro * accum * world_size
    if given is not None and given != total:
        raise ValueError(
            f"run.deepspeed_config.train_batch_size={given} but train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={accum} x world size {world_size} = {total}; "
            "make them agree or drop train_batch_size")
    return micro, accum, total


def elastic_batch_sizes(micro: int, global_batch: int, world_size: int, source: str) -> tuple[int, int, int]:
    """(micro, accumulation, global) keeping ``global_batch`` on ``world_size`` processes, or a ValueError."""
    if global_batch % (micro * world_size):
        fits = [w for w in range(1, global_batch // micro + 1) if global_batch % (micro * w) == 0]
        raise ValueError(
            f"{source}: a global batch of {global_batch} cannot be split into micro-batches of {micro} on "
            f"{world_size} processes ({global_batch} is not a multiple of {micro} x {world_size}); "
            f"process counts that keep it: {', '.join(map(str, fits))}")
    return micro, global_batch // (micro * world_size), global_batch


def deepspeed_problems(ds: dict) -> list[str]:
    """Checks of the pass-through DeepSpeed section that DeepSpeed itself reports badly."""
    path = "run.deepspeed_config"
    errors = []
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        errors.append(f"{path}.zero_optimization.stage: {stage!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
    if (ds.get("bf16") or {}).get("enabled") and (ds.get("fp16") or {}).get("enabled"):
        errors.append(f"{path}: bf16.enabled and fp16.enabled are both true; pick one")
    if "scheduler" in ds:
        errors.append(f"{path}.scheduler: lavis_ds steps the learning rate itself (run.lr_sched, run.init_lr, ...); "
                      "remove this section")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        value = ds.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            errors.append(f"{path}.{key}: expected a positive integer, got {value!r}")
    return errors


def build_deepspeed_config(run: dict, world_size: int) -> dict:
    """The JSON handed to deepspeed.initialize: the user's section, completed."""
    ds = copy.deepcopy(dict(run.get("deepspeed_config") or {}))
    micro, accum, total = batch_sizes(run, world_size)
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=total)
    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = optimizer.setdefault("params", {})
    # The scheduler overwrites lr before the first step; weight decay lives in the param groups.
    params.setdefault("lr", run["init_lr"])
    params.setdefault("weight_decay", run["weight_decay"])
    ds.setdefault("steps_per_print", 10**9)  # our logger reports; DeepSpeed's own would duplicate it
    ds.setdefault("wall_clock_breakdown", False)
    offload = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    if offload != "none":
        ds.setdefault("zero_force_ds_cpu_optimizer", True)
    return ds
