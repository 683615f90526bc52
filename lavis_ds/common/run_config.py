"""The `run:` section: its keys, their defaults, and the DeepSpeed JSON derived from it."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from lavis_ds.common.schema import Range

NonNegative = Range(ge=0)
Positive = Range(gt=0)
AtLeastOne = Range(ge=1)


@dataclass
class RunConfig:
    """Schema of `run:`. Field names are the YAML keys; see README "Config keys"."""

    output_dir: str
    runner: str = "runner_deepspeed"
    lr_sched: str = "linear_warmup_cosine_lr"
    init_lr: Annotated[float, NonNegative] = 1e-4
    min_lr: Annotated[float, NonNegative] = 0.0
    warmup_lr: Annotated[float, NonNegative] = 0.0
    warmup_steps: Annotated[int, NonNegative] = 0
    # overrides warmup_steps: fraction of all optimizer steps
    warmup_ratio: Annotated[float | None, Range(ge=0, le=1)] = None
    lr_decay_rate: Annotated[float, Positive] = 0.1  # linear_warmup_step_lr: factor per epoch
    weight_decay: Annotated[float, NonNegative] = 0.05
    lr_scales: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> lr factor
    max_epoch: Annotated[int, AtLeastOne] = 1
    # micro-batch per process (= train_micro_batch_size_per_gpu)
    batch_size_train: Annotated[int | None, AtLeastOne] = None
    batch_size_eval: Annotated[int, AtLeastOne] = 8
    num_workers: Annotated[int, NonNegative] = 0
    seed: Annotated[int, NonNegative] = 42  # numpy takes seeds in [0, 2**32)
    log_freq: Annotated[int, AtLeastOne] = 10  # optimizer steps
    save_freq_steps: Annotated[int, NonNegative] = 0  # optimizer steps; 0 = only at epoch ends
    # newest complete checkpoints to keep, plus the best by `best_metric`; 0 = all
    keep_last: Annotated[int, NonNegative] = 0
    resume: Any = "auto"  # "auto" | false | path to a checkpoint
    resume_ckpt_load_dir: str | None = None  # MiniGPT4Qwen spelling of `resume`
    resume_ckpt_tag: str | None = None
    evaluate: bool = False  # evaluate only, no training
    train_splits: list[str] = field(default_factory=lambda: ["train"])
    valid_splits: list[str] = field(default_factory=list)
    test_splits: list[str] = field(default_factory=list)
    generate: dict[str, Any] = field(default_factory=dict)  # kwargs of model.generate for evaluation
    test_metrics: list[str] = field(default_factory=lambda: ["exact_match"])  # registered metrics of test splits
    val_metrics: list[str] = field(default_factory=list)  # generation metrics of valid splits (besides the loss)
    val_freq_steps: Annotated[int, NonNegative] = 0  # validate every N optimizer steps too; 0 = at epoch ends only
    best_metric: str | None = None  # "<split>/<logged key>", e.g. val/caption/CIDEr; default: first valid split's loss
    num_log_samples: Annotated[int, NonNegative] = 5  # generated samples written to metrics.jsonl per test split
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss: stop the run, or skip that optimizer step
    # the DeepSpeed JSON, inline or as the path of a .json file (see lavis_ds.common.deepspeed_section)
    deepspeed_config: dict[str, Any] | str = field(default_factory=dict)


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


def deepspeed_problems(ds: dict, run: dict | None = None) -> list[str]:
    """Checks of the pass-through DeepSpeed section that DeepSpeed itself reports badly, and its agreement
    with the run keys that set the same thing (``run`` given)."""
    path = "run.deepspeed_config"
    errors = []
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        errors.append(f"{path}.zero_optimization.stage: {stage!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
    if (ds.get("bf16") or {}).get("enabled") and (ds.get("fp16") or {}).get("enabled"):
        errors.append(f"{path}: bf16.enabled and fp16.enabled are both true; pick one")
    if "scheduler" in ds:
        errors.append(f"{path}.scheduler: lavis_ds steps the learning rate itself (run.lr_sched, run.init_lr, ...); "
                      "remove this section (a section whose params are all \"auto\" is dropped for you)")
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        value = ds.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            errors.append(f"{path}.{key}: expected a positive integer, got {value!r}")
    clip = ds.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        errors.append(f"{path}.gradient_clipping: expected a number >= 0 (0: no clipping), got {clip!r}")
    params = (ds.get("optimizer") or {}).get("params") or {} if isinstance(ds.get("optimizer"), dict) else {}
    # The schedule writes run.init_lr (x lr_scales) into every group, and weight decay lives in the param
    # groups: a different value here would be silently overwritten.
    for key, run_key in (("lr", "init_lr"), ("weight_decay", "weight_decay")):
        if run is not None and isinstance(params, dict) and key in params and params[key] != run.get(run_key):
            errors.append(f"{path}.optimizer.params.{key}={params[key]!r} and run.{run_key}={run.get(run_key)!r} "
                          f"disagree; lavis_ds sets the optimizer's {key} from run.{run_key}: drop one or make them equal")
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
