"""The `run:` section: its keys, their defaults, and the training settings every engine reads.

Micro-batch, accumulation, global batch, clipping, precision and AdamW's betas/eps are engine-neutral
`run` keys. An engine's own options section may set the same things in its engine's words (a YAML
written for DeepSpeed keeps working under every engine): each engine names those twins, the config
loader maps them onto the run keys, and a value given both ways must agree. The ZeRO keys (stage,
offload) are run keys too, read by the DeepSpeed engine only; their twins in the DeepSpeed section
are checked the same way.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from lavis_ds.common.schema import Range

NonNegative = Range(ge=0)
Positive = Range(gt=0)
AtLeastOne = Range(ge=1)


@dataclass
class RunConfig:
    """Schema of `run:`. Field names are the YAML keys; see docs/config.md."""

    output_dir: str
    # the training objective (LAVIS's key): a registered objective, options in the run section of its name
    # (run.task: dpo, run.dpo: {beta: 0.1}); unset: sft. LAVIS's task names (image_text_pretrain, ...) mean sft
    task: str | None = None
    runner: str | None = None  # a registered engine; unset: the default one (lavis_ds.runners.DEFAULT_ENGINE)
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
    precision: Literal["fp32", "bf16", "fp16", None] = None  # training precision; unset: a twin's, or fp32
    adam_betas: tuple[float, float] | None = None  # AdamW's (beta1, beta2); unset: (0.9, 0.999)
    adam_eps: Annotated[float | None, Positive] = None  # AdamW's eps; unset: 1e-8
    # the DeepSpeed engine's ZeRO settings (ZERO_KEYS); unset: what its JSON section says, else stage 0, no offload
    zero_stage: Literal[0, 1, 2, 3, None] = None
    offload_optimizer: bool | None = None  # optimizer states and step in CPU RAM (DeepSpeedCPUAdam); stages 1-3
    offload_params: bool | None = None  # parameters in CPU RAM between uses; stage 3
    batch_size_eval: Annotated[int, AtLeastOne] = 8
    num_workers: Annotated[int, NonNegative] = 0
    seed: Annotated[int, NonNegative] = 42  # numpy takes seeds in [0, 2**32)
    log_freq: Annotated[int, AtLeastOne] = 10  # optimizer steps
    save_freq_steps: Annotated[int, NonNegative] = 0  # optimizer steps; 0 = only at epoch ends
    # newest complete checkpoints to keep, plus the best by `best_metric`; 0 = all
    keep_last: Annotated[int, NonNegative] = 0
    resume: Any = "auto"  # "auto" | false | path to a checkpoint
    evaluate: bool = False  # evaluate only, no training
    train_splits: list[str] = field(default_factory=lambda: ["train"])
    valid_splits: list[str] = field(default_factory=list)
    test_splits: list[str] = field(default_factory=list)
    generate: dict[str, Any] = field(default_factory=dict)  # kwargs of model.generate for evaluation
    test_metrics: list[str] = field(default_factory=lambda: ["exact_match"])  # registered metrics of test splits
    val_metrics: list[str] = field(default_factory=list)  # generation metrics of valid splits (besides the loss)
    val_freq_steps: Annotated[int, NonNegative] = 0  # validate every N optimizer steps too; 0 = at epoch ends only
    # "<split>/<logged key>", e.g. val/caption/CIDEr, or lmms_eval/<task>/<metric>; default: first valid split's loss
    best_metric: str | None = None
    # benchmarks in the loop: {tasks: [...], every: N | epoch, limit, num_fewshot, batch_size, include_path}, run by
    # lmms-eval on the live model (runners.hooks.lmms_eval_checks.LmmsEvalSettings; docs/evaluation.md)
    lmms_eval: dict[str, Any] | None = None
    num_log_samples: Annotated[int, NonNegative] = 5  # generated samples written to metrics.jsonl per test split
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss: stop the run, or skip that optimizer step
    # GPU numerics (common.device): TF32 matmuls on Ampere and later; deterministic kernels (a GPU run repeats
    # bit for bit, so exact resumption holds there too, at some speed: docs/benchmarks.md)
    tf32: bool = True
    # an optimizer step's loss: the summed token losses over the supervised tokens of the whole global batch (every
    # micro-batch and rank; the same whatever the split), or LAVIS's mean of per-micro-batch means (old runs)
    loss_reduction: Literal["tokens", "micro_batch"] = "tokens"
    # padding-free packing: each micro-batch's samples laid end to end in rows of at most max_seq_len tokens, each
    # sample attending only to itself (lavis_ds.models.packing); max_seq_len >= model.max_txt_len
    packing: bool = False
    # LLaVA's modality-length grouping, the light option: each step's samples sorted by length (text-only apart)
    # into micro-batches of neighbours, so each pads less; the step's samples and loss are unchanged
    length_grouped: bool = False
    max_seq_len: Annotated[int | None, AtLeastOne] = None
    # what batch_size_train counts: samples, or rows of max_seq_len tokens that samples fill (a token budget:
    # each micro-batch takes as many samples as fit in batch_size_train x max_seq_len tokens, so the global batch
    # is global_batch_tokens). Unset: tokens with packing, else samples
    batch_unit: Literal["samples", "tokens", None] = None
    # with batch_unit tokens: tokens per optimizer step (= global_batch_size x max_seq_len); like
    # global_batch_size, it fixes the accumulation if that is unset. config.yaml records the resolved value
    global_batch_tokens: Annotated[int | None, AtLeastOne] = None
    deterministic: bool = False
    # peak TFLOP/s of one device, the denominator of the logged MFU; unset: A100/H100/H200 bf16 from the device name
    peak_tflops: Annotated[float | None, Positive] = None
    # optional hooks after the built-in ones, in run order: registered names, or {name: ..., <its options>}
    # (trackers: tensorboard, mlflow, wandb; a user's own under `imports:`). docs/hooks.md
    hooks: list[str | dict[str, Any]] = field(default_factory=lambda: ["tensorboard"])
    # Each engine's own options section is a run key too, named by the engine (Engine.config.KEY).


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainingSettings:
    """What every engine needs to know to step like every other: batch layout, clipping, precision."""

    micro_batch: int
    accum: int
    global_batch: int
    grad_norm_clip: float  # 0: no clipping
    precision: str  # one of PRECISIONS


NEUTRAL_KEYS = ("batch_size_train", "accum_grad_iters", "global_batch_size", "grad_norm_clip", "precision",
                "adam_betas", "adam_eps")
# Run keys of the DeepSpeed engine alone, with twins in its section; other engines leave them unread (a log line
# says so), and the DeepSpeed engine writes them into the JSON it is handed.
ZERO_KEYS = ("zero_stage", "offload_optimizer", "offload_params")


@dataclass(frozen=True)
class Twin:
    """A neutral run key's (or a ZeRO key's) setting written in an engine's own options section in its engine's
    words (the DeepSpeed JSON's micro-batch key for ``run.batch_size_train``). Runners name theirs
    (``Engine.config.twins``); the config loader maps them onto the run key, whichever engine runs."""

    key: str  # the run key
    path: str  # where the user wrote it: run.<options section>.<key path>
    written: Any  # what the user wrote there
    value: Any  # the run key's value it means
    negated: bool = False  # it says the run key is *not* ``value`` (a precision switched off)

    def agrees(self, value: Any) -> bool:
        return (value == self.value) != self.negated


def valid_betas(value: Any) -> bool:
    """Whether ``value`` is AdamW's (beta1, beta2): two numbers in [0, 1)."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)


def resolve_twins(run: dict, twins: list[Twin]) -> tuple[dict, dict[str, str]]:
    """``run`` with every unset neutral or ZeRO key taken from a twin, and where each value so taken was written;
    ValueError naming two settings that disagree."""
    run, taken = dict(run), {}
    for key in NEUTRAL_KEYS + ZERO_KEYS:
        for twin in (t for t in twins if t.key == key):
            mine = run.get(key)
            if mine is not None and not twin.agrees(mine):
                where = f"{taken[key].path}={taken[key].written!r}" if key in taken else f"run.{key}={mine!r}"
                raise ValueError(f"{where} and {twin.path}={twin.written!r} disagree; they are the same setting, "
                                 f"give one")
            if mine is None and not twin.negated:
                run[key], taken[key] = twin.value, twin
    return run, {key: twin.path for key, twin in taken.items()}


def training_settings(run: dict, world_size: int, spelled: dict[str, str] | None = None) -> TrainingSettings:
    """The run's training settings from its neutral keys; ValueError naming a disagreement. ``spelled``: where
    a value was written if not as its run key (``resolve_twins``), for the messages."""
    named = functools.partial(_named, spelled=spelled or {})
    micro, accum, given = run.get("batch_size_train"), run.get("accum_grad_iters"), run.get("global_batch_size")
    if micro is None:
        raise ValueError("run.batch_size_train (the micro-batch per process) is required")
    if accum is None and given is not None:  # as DeepSpeed does: the global batch fixes the accumulation
        micro, accum, total = elastic_batch_sizes(micro, given, world_size, named("global_batch_size", full=True))
    else:
        accum = 1 if accum is None else accum
        total = micro * accum * world_size
        if given is not None and given != total:
            raise ValueError(
                f"{named('global_batch_size', full=True)}={given} but {named('batch_size_train')}={micro} x "
                f"{named('accum_grad_iters')}={accum} x world size {world_size} = {total}; "
                "make them agree or drop the global batch size")
    return TrainingSettings(micro, accum, total, float(run.get("grad_norm_clip") or 0.0),
                            run.get("precision") or "fp32")


def batch_unit(run: Any) -> str:
    """What run.batch_size_train counts: ``tokens`` (rows of run.max_seq_len) or ``samples``; unset: tokens when
    packing."""
    return run.get("batch_unit") or ("tokens" if run.get("packing") else "samples")


def with_batch_layout(run: dict, micro: int, accum: int, global_batch: int) -> dict:
    """A copy of ``run`` whose batch keys say this layout (the trainer's: an elastic resume changes accumulation)."""
    return {**run, "batch_size_train": micro, "accum_grad_iters": accum, "global_batch_size": global_batch}


def _named(key: str, spelled: dict[str, str], full: bool = False) -> str:
    """The key the user wrote for a setting: its twin's path if the value came from one, else the run key."""
    if key in spelled:
        return spelled[key] if full else spelled[key].rpartition(".")[2]
    return ("run." if full else "") + key


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
