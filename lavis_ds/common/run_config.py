"""The `run:` section: its keys, their defaults, and the training settings every engine reads.

Micro-batch, accumulation, global batch, clipping and precision are engine-neutral `run` keys. A
DeepSpeed section may set the same things in DeepSpeed's words (YAMLs written for DeepSpeed keep
working under every runner); a value given both ways must agree.
"""
from __future__ import annotations

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
    # micro-batch per process (DeepSpeed: train_micro_batch_size_per_gpu)
    batch_size_train: Annotated[int | None, AtLeastOne] = None
    # micro-batches per optimizer step (DeepSpeed: gradient_accumulation_steps); default 1, or from global_batch_size
    accum_grad_iters: Annotated[int | None, AtLeastOne] = None
    global_batch_size: Annotated[int | None, AtLeastOne] = None  # samples per optimizer step (DeepSpeed: train_batch_size)
    grad_norm_clip: Annotated[float | None, NonNegative] = None  # max global gradient norm; 0 or unset: no clipping
    precision: Literal["fp32", "bf16", "fp16", None] = None  # training precision; unset: the DeepSpeed section's, or fp32
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
    # runner_deepspeed's options: the DeepSpeed JSON, inline or as the path of a .json file (deepspeed_section)
    deepspeed_config: dict[str, Any] | str = field(default_factory=dict)
    fsdp: dict[str, Any] | bool = field(default_factory=dict)  # runner_fsdp's options (FSDPOptions)


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainingSettings:
    """What every engine needs to know to step like every other: batch layout, clipping, precision."""

    micro_batch: int
    accum: int
    global_batch: int
    grad_norm_clip: float  # 0: no clipping
    precision: str  # one of PRECISIONS


# run key -> the DeepSpeed key that says the same thing
DEEPSPEED_TWINS = {
    "batch_size_train": "train_micro_batch_size_per_gpu",
    "accum_grad_iters": "gradient_accumulation_steps",
    "global_batch_size": "train_batch_size",
    "grad_norm_clip": "gradient_clipping",
}


def training_settings(run: dict, world_size: int) -> TrainingSettings:
    """The run's training settings from its neutral keys and DeepSpeed section; ValueError naming a disagreement."""
    ds = run.get("deepspeed_config") if isinstance(run.get("deepspeed_config"), dict) else {}
    value = {}
    for key, twin in DEEPSPEED_TWINS.items():
        mine, theirs = run.get(key), ds.get(twin)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"run.{key}={mine!r} and run.deepspeed_config.{twin}={theirs!r} disagree; they are the "
                             f"same setting, give one")
        value[key] = mine if mine is not None else theirs
    micro, accum, given = value["batch_size_train"], value["accum_grad_iters"], value["global_batch_size"]
    if micro is None:
        raise ValueError("run.batch_size_train (the micro-batch per process) is required "
                         "(or run.deepspeed_config.train_micro_batch_size_per_gpu)")
    if accum is None and given is not None:  # as DeepSpeed does: the global batch fixes the accumulation
        micro, accum, total = elastic_batch_sizes(micro, given, world_size, _named("global_batch_size", run, full=True))
    else:
        accum = 1 if accum is None else accum
        total = micro * accum * world_size
        if given is not None and given != total:
            raise ValueError(
                f"{_named('global_batch_size', run, full=True)}={given} but {_named('batch_size_train', run)}={micro} x "
                f"{_named('accum_grad_iters', run)}={accum} x world size {world_size} = {total}; "
                "make them agree or drop the global batch size")
    return TrainingSettings(micro, accum, total, float(value["grad_norm_clip"] or 0.0),
                            _precision(run.get("precision"), ds))


def with_batch_layout(run: dict, micro: int, accum: int, global_batch: int) -> dict:
    """A copy of ``run`` whose batch keys say this layout (the runner's: an elastic resume changes the accumulation)."""
    ds = {k: v for k, v in (run.get("deepspeed_config") or {}).items() if k not in DEEPSPEED_TWINS.values()
          or k == "gradient_clipping"}
    return {**run, "deepspeed_config": ds, "batch_size_train": micro, "accum_grad_iters": accum,
            "global_batch_size": global_batch}


def _named(key: str, run: dict, full: bool = False) -> str:
    """The key the user wrote for a setting: the run key, or else its DeepSpeed twin (if given); ``full``: its path."""
    ds = run.get("deepspeed_config") if isinstance(run.get("deepspeed_config"), dict) else {}
    if run.get(key) is None and ds.get(DEEPSPEED_TWINS[key]) is not None:
        return ("run.deepspeed_config." if full else "") + DEEPSPEED_TWINS[key]
    return ("run." if full else "") + key


def precision_switches(run: dict) -> dict[str, tuple[str, bool]]:
    """The precision switches the run's DeepSpeed section sets: their key path -> (precision, on or off)."""
    ds = run.get("deepspeed_config") if isinstance(run.get("deepspeed_config"), dict) else {}
    return {f"run.deepspeed_config.{key}.enabled": (key, ds[key]["enabled"]) for key in ("bf16", "fp16")
            if isinstance(ds.get(key), dict) and isinstance(ds[key].get("enabled"), bool)}


def _precision(precision: str | None, ds: dict) -> str:
    enabled = [key for key in ("bf16", "fp16") if isinstance(ds.get(key), dict) and ds[key].get("enabled") is True]
    if "bf16" not in enabled and isinstance(ds.get("bfloat16"), dict) and ds["bfloat16"].get("enabled") is True:
        enabled.append("bf16")  # DeepSpeed's older spelling
    if len(enabled) > 1:
        raise ValueError("run.deepspeed_config: bf16.enabled and fp16.enabled are both true; pick one")
    theirs = enabled[0] if enabled else None
    if precision is not None and theirs is not None and precision != theirs:
        raise ValueError(f"run.precision={precision!r} and run.deepspeed_config.{theirs}.enabled=true disagree; "
                         "they are the same setting, give one")
    explicit_off = [key for key in ("bf16", "fp16") if isinstance(ds.get(key), dict) and ds[key].get("enabled") is False]
    if precision in explicit_off:
        raise ValueError(f"run.precision={precision!r} and run.deepspeed_config.{precision}.enabled=false disagree; "
                         "they are the same setting, give one")
    return precision or theirs or "fp32"


def batch_sizes(run: dict, world_size: int) -> tuple[int, int, int]:
    """(micro, accumulation, global) batch sizes, or ValueError saying which disagree."""
    settings = training_settings(run, world_size)
    return settings.micro_batch, settings.accum, settings.global_batch


def elastic_batch_sizes(micro: int, global_batch: int, world_size: int, source: str) -> tuple[int, int, int]:
    """(micro, accumulation, global) keeping ``global_batch`` on ``world_size`` processes, or a ValueError."""
    if global_batch % (micro * world_size):
        fits = [w for w in range(1, global_batch // micro + 1) if global_batch % (micro * w) == 0]
        raise ValueError(
            f"{source}: a global batch of {global_batch} cannot be split into micro-batches of {micro} on "
            f"{world_size} processes ({global_batch} is not a multiple of {micro} x {world_size}); "
            f"process counts that keep it: {', '.join(map(str, fits))}")
    return micro, global_batch // (micro * world_size), global_batch
