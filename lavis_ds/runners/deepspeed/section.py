"""`run.deepspeed_config` as users bring it: a JSON file, Hugging Face's "auto" values, checked by DeepSpeed.

Hugging Face's DeepSpeed integration documents config files whose values may be
``"auto"`` (filled from the Trainer's arguments). The same files work here:
an "auto" is filled from the run's own keys where the run has one (``init_lr``,
``weight_decay``, ``batch_size_train``, ``accum_grad_iters``, ``grad_norm_clip``...), otherwise it is left out so DeepSpeed
uses its default; a ``scheduler`` section that is all "auto" is dropped, since
lavis_ds steps the learning rate itself. Each of these is said once in the log.

The section is then checked with DeepSpeed's own config models (pydantic) before
any model is built, so a typo is reported with its key path and the closest
valid key instead of surfacing after minutes of model loading.
"""
from __future__ import annotations

import copy
import json
import os
import typing
from pathlib import Path
from typing import Any

from lavis_ds.common.run_config import Twin, training_settings, valid_betas
from lavis_ds.common.suggest import did_you_mean
from lavis_ds.runners.deepspeed import zero_keys
from lavis_ds.runners.deepspeed.library import load_deepspeed

WHERE = "run.deepspeed_config"
AUTO = "auto"

# "auto" path -> the run key that fills it (Hugging Face fills these from its TrainingArguments).
AUTO_FROM_RUN = {
    ("train_micro_batch_size_per_gpu",): "batch_size_train",
    ("gradient_accumulation_steps",): "accum_grad_iters",
    ("train_batch_size",): "global_batch_size",
    ("gradient_clipping",): "grad_norm_clip",
    ("optimizer", "params", "lr"): "init_lr",
    ("optimizer", "params", "weight_decay"): "weight_decay",
}
# "auto" paths whose value lavis_ds computes itself (left out here, filled when the engine is configured).
AUTO_COMPUTED = {
    ("train_batch_size",): "micro-batch x gradient accumulation x processes",
    ("gradient_accumulation_steps",): "1, or global batch / (micro-batch x processes)",
    ("bf16", "enabled"): "run.precision",
    ("fp16", "enabled"): "run.precision",
}


# run key -> the DeepSpeed key that says the same thing (a YAML written for DeepSpeed keeps its batch,
# clipping, precision and AdamW settings under every engine: Engine.config.twins)
TWIN_KEYS = {
    "batch_size_train": "train_micro_batch_size_per_gpu",
    "accum_grad_iters": "gradient_accumulation_steps",
    "global_batch_size": "train_batch_size",
    "grad_norm_clip": "gradient_clipping",
}
PRECISION_SWITCHES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}  # section -> run.precision (bfloat16: older)


def option_twins(ds: dict) -> tuple[list[Twin], list[str]]:
    """What the section says about the neutral run keys and the ZeRO keys (its "auto" values say nothing: the run
    fills them)."""
    twins, problems = zero_keys.twins(ds), []
    for key, ds_key in TWIN_KEYS.items():
        value = ds.get(ds_key)
        if value is None or value == AUTO:
            continue
        number = _is_number(value)
        if key == "grad_norm_clip" and not (number and value >= 0):
            problems.append(f"{WHERE}.{ds_key}: expected a number >= 0 (0: no clipping), got {value!r}")
        elif key != "grad_norm_clip" and not (number and isinstance(value, int) and value >= 1):
            problems.append(f"{WHERE}.{ds_key}: expected a positive integer, got {value!r}")
        else:
            twins.append(Twin(key, f"{WHERE}.{ds_key}", value, value))
    for name, precision in PRECISION_SWITCHES.items():
        enabled = ds[name].get("enabled") if isinstance(ds.get(name), dict) else None
        if isinstance(enabled, bool):  # off says only "not this precision"
            twins.append(Twin("precision", f"{WHERE}.{name}.enabled", enabled, precision, negated=not enabled))
    optimizer = ds.get("optimizer") if isinstance(ds.get("optimizer"), dict) else {}
    params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
    betas, eps = params.get("betas"), params.get("eps")
    if betas is not None and betas != AUTO:
        if valid_betas(betas):
            twins.append(Twin("adam_betas", f"{WHERE}.optimizer.params.betas", betas, list(betas)))
        else:
            problems.append(f"{WHERE}.optimizer.params.betas: expected two numbers in [0, 1) (beta1, beta2), "
                            f"got {betas!r}")
    if eps is not None and eps != AUTO:
        if _is_number(eps) and eps > 0:
            twins.append(Twin("adam_eps", f"{WHERE}.optimizer.params.eps", eps, eps))
        else:
            problems.append(f"{WHERE}.optimizer.params.eps: expected a number > 0, got {eps!r}")
    return twins, problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_section(value: Any) -> tuple[dict | None, list[str]]:
    """The section as a dict: inline, or read from the JSON file a string names (relative to the working directory)."""
    if value is None:
        return {}, []
    if isinstance(value, dict):
        return value, []
    if not isinstance(value, str):
        return None, [f"{WHERE}: expected a mapping or the path of a DeepSpeed JSON file, got {value!r}"]
    path = Path(os.path.expanduser(value))
    if not path.is_file():
        return None, [f"{WHERE}: DeepSpeed JSON file {value!r} not found (relative paths are relative to the "
                      f"working directory, {os.getcwd()})"]
    try:
        loaded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [f"{WHERE}: {path} is not valid JSON: {e}"]
    if not isinstance(loaded, dict):
        return None, [f"{WHERE}: {path} must hold a JSON object (the DeepSpeed config), got {type(loaded).__name__}"]
    return loaded, []


def _auto_paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, prefix + (str(k),))]
    return [prefix] if node == AUTO else []


def _pop(ds: dict, path: tuple[str, ...]) -> None:
    node = ds
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]


def _set(ds: dict, path: tuple[str, ...], value: Any) -> None:
    node = ds
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def resolve_auto(ds: dict, run: dict) -> tuple[dict, list[str]]:
    """``ds`` with every "auto" filled from ``run`` or left out, and the notices saying which.

    Call after the LAVIS keys were translated (they fill autos of their own first).
    """
    ds = copy.deepcopy(ds)
    notices = []
    scheduler = ds.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    if isinstance(params, dict) and params and all(value == AUTO for value in _leaves(params)):
        del ds["scheduler"]
        notices.append(f"{WHERE}.scheduler: dropped ({scheduler.get('type', 'no type')} with only \"auto\" values); "
                       f"lavis_ds steps the learning rate itself from run.lr_sched, run.init_lr, run.warmup_steps, ...")
    filled, computed, defaulted = [], [], []
    for path in _auto_paths(ds):
        dotted = ".".join(path)
        run_key = AUTO_FROM_RUN.get(path)
        if run_key is not None and run.get(run_key) is not None:
            _set(ds, path, run[run_key])
            filled.append(f"{dotted} = run.{run_key} ({run[run_key]!r})")
            continue
        if path in (("bf16", "enabled"), ("fp16", "enabled")):
            _pop(ds, path)  # run.precision decides (build_deepspeed_config)
        else:
            _pop(ds, path)
        if path in AUTO_COMPUTED:
            computed.append(f"{dotted} ({AUTO_COMPUTED[path]})")
        else:
            defaulted.append(dotted)
    for parent in ("optimizer", "scheduler"):  # a params section emptied of autos: the rest still stands
        if isinstance(ds.get(parent), dict) and ds[parent].get("params") == {}:
            del ds[parent]["params"]
    if filled or computed or defaulted:
        parts = ([f"filled from the run: {', '.join(filled)}"] if filled else []) + \
                ([f"computed by lavis_ds: {', '.join(computed)}"] if computed else []) + \
                ([f"left to DeepSpeed's defaults: {', '.join(defaulted)}"] if defaulted else [])
        notices.append(f"{WHERE}: \"auto\" values " + "; ".join(parts))
    return ds, notices


def _leaves(node: Any) -> list:
    if isinstance(node, dict):
        return [leaf for v in node.values() for leaf in _leaves(v)]
    return [node]


# ----------------------------------------------------------------------------------------------------------------
# Checked by DeepSpeed's own config models


def _pydantic_sections() -> dict[str, type]:
    """Top-level keys DeepSpeed builds a pydantic model from, checked one by one so every bad section is reported."""
    load_deepspeed()
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config,
            "fp16": DeepSpeedFP16Config}


# Plain (not pydantic) sections whose keys DeepSpeed reads one by one: a key it never reads is a typo.
_READ_SECTIONS = ("activation_checkpointing", "flops_profiler", "optimizer", "scheduler")
# Read by DeepSpeed only when `type` is given (a typo in `type` must not make `params` look unknown too).
_ALWAYS_VALID = {"optimizer.type", "optimizer.params", "scheduler.type", "scheduler.params"}


class _ReadRecorder(dict):
    """A dict that notes which keys DeepSpeed asks for (``get``, ``[]``, ``in``)."""

    def __init__(self, data: dict, prefix: str, read: set[str], depth: int):
        super().__init__({k: _ReadRecorder(v, f"{prefix}{k}.", read, depth - 1)
                          if isinstance(v, dict) and depth > 0 and (prefix or k in _READ_SECTIONS) else v
                          for k, v in data.items()})
        self._prefix, self._read = prefix, read

    def _note(self, key: Any) -> None:
        self._read.add(f"{self._prefix}{key}")

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._note(key)
        return super().__contains__(key)

    def keys(self):  # `x in d.keys()` asks for x only: it must not count as reading every key
        return _RecordedKeys(self)


class _RecordedKeys:
    def __init__(self, recorder: _ReadRecorder):
        self._recorder = recorder

    def __contains__(self, key) -> bool:
        return key in self._recorder

    def __iter__(self):
        return iter(dict.keys(self._recorder))

    def __len__(self) -> int:
        return dict.__len__(self._recorder)


def schema_problems(ds: dict) -> list[str]:
    """Every key path of ``ds`` that DeepSpeed's config would refuse or never read, with the closest valid key."""
    from pydantic import ValidationError

    problems = []
    bad_sections = set()
    for key, model in _pydantic_sections().items():
        if isinstance(ds.get(key), dict):
            try:
                model(**ds[key])
            except ValidationError as e:
                problems += [_describe(f"{WHERE}.{key}", model, err) for err in e.errors()]
                bad_sections.add(key)

    load_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    read: set[str] = set()
    # The global batch is checked against the world size elsewhere (DeepSpeed here would assume one process);
    # sections already reported are left out so that the rest is still checked.
    probe = {k: v for k, v in ds.items() if k != "train_batch_size" and k not in bad_sections}
    try:
        DeepSpeedConfig(_ReadRecorder(probe, "", read, depth=1))
    except ValidationError as e:
        section = {m.__name__: k for k, m in _pydantic_sections().items()}.get(e.title, e.title)
        return problems + [f"{WHERE}.{section}.{'.'.join(map(str, err['loc']))}: {err['msg']} "
                           f"(got {err['input']!r})" for err in e.errors()]
    except Exception as e:  # DeepSpeed's own sanity checks (asserts, ValueErrors): its message, with where
        return problems + [f"{WHERE}: DeepSpeed refuses it: {type(e).__name__}: {e}"]
    for dotted in _key_paths(probe):
        if dotted in read or dotted in bad_sections or dotted in _ALWAYS_VALID:
            continue
        parent, _, key = dotted.rpartition(".")
        level = {r.rpartition(".")[2] for r in read | _ALWAYS_VALID if r.rpartition(".")[0] == parent}
        hint = did_you_mean(key, level, "DeepSpeed does not read it")
        problems.append(f"{WHERE}.{dotted}: unknown key; {hint}")
    return problems


def _key_paths(ds: dict) -> list[str]:
    """Top-level keys, and the keys of the plain sections DeepSpeed reads one by one."""
    out = []
    for k, v in ds.items():
        out.append(str(k))
        if k in _READ_SECTIONS and isinstance(v, dict):
            out += [f"{k}.{sub}" for sub in v]
    return out


def _describe(where: str, model: type, err: dict) -> str:
    loc = [str(part) for part in err["loc"]]
    path = ".".join([where, *loc])
    if err["type"] != "extra_forbidden":
        return f"{path}: {err['msg']} (got {err['input']!r})"
    owner = model
    for part in loc[:-1]:  # the nested model that holds the unknown key
        field = _field(owner, part)
        owner = _model_of(field.annotation) if field is not None else None
        if owner is None:
            break
    valid = _valid_keys(owner) if owner is not None else []
    hint = did_you_mean(loc[-1], valid, f"valid keys: {', '.join(sorted(valid))}")
    return f"{path}: unknown key; {hint}"


def _field(model: type, name: str):
    fields = model.model_fields
    if name in fields:
        return fields[name]
    return next((f for f in fields.values() if f.alias == name), None)


def _model_of(annotation: Any) -> type | None:
    """The pydantic model inside an annotation such as ``Optional[DeepSpeedZeroOffloadOptimizerConfig]``."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_of, typing.get_args(annotation)) if m is not None), None)


def _valid_keys(model: type) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            continue
        keys.append(field.alias or name)
    return keys


def deepspeed_problems(ds: dict, run: dict | None = None) -> list[str]:
    """Checks of the pass-through DeepSpeed section that DeepSpeed itself reports badly, and its agreement
    with the run keys that set the same thing (``run`` given)."""
    path = "run.deepspeed_config"
    errors = []
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        errors.append(f"{path}.zero_optimization.stage: {stage!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
    if "scheduler" in ds:
        errors.append(f"{path}.scheduler: lavis_ds steps the learning rate itself (run.lr_sched, run.init_lr, ...); "
                      "remove this section (a section whose params are all \"auto\" is dropped for you)")
    # The values of the run keys' twins are checked with them (DeepSpeedEngineConfig.twins), whichever engine runs.
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
    if "bfloat16" in ds:  # DeepSpeed's older spelling
        ds["bf16"] = {**ds.pop("bfloat16"), **(ds.get("bf16") or {})}
    settings = training_settings(run, world_size)  # the run keys, which the loader resolved with their twins
    ds.update(train_micro_batch_size_per_gpu=settings.micro_batch, gradient_accumulation_steps=settings.accum,
              train_batch_size=settings.global_batch)
    if settings.grad_norm_clip or "gradient_clipping" in ds:
        ds["gradient_clipping"] = settings.grad_norm_clip
    for key in ("bf16", "fp16"):
        if settings.precision == key or key in ds:
            ds[key] = {**(ds.get(key) or {}), "enabled": settings.precision == key}
    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = optimizer.setdefault("params", {})
    # The scheduler overwrites lr before the first step; weight decay lives in the param groups.
    params.setdefault("lr", run["init_lr"])
    params.setdefault("weight_decay", run["weight_decay"])
    for key, run_key in (("betas", "adam_betas"), ("eps", "adam_eps")):
        if run.get(run_key) is not None:
            params[key] = run[run_key]
    zero_keys.apply(ds, run)
    ds.setdefault("steps_per_print", 10**9)  # our logger reports; DeepSpeed's own would duplicate it
    ds.setdefault("wall_clock_breakdown", False)
    offload = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    if offload != "none":
        ds.setdefault("zero_force_ds_cpu_optimizer", True)
    return ds
