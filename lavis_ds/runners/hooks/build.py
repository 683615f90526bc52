"""From `run.hooks` to the run's hooks, and the config check of that list.

`run.hooks` lists the optional hooks, each a registered name or a mapping of its name and options::

    hooks:
      - tensorboard
      - {name: mlflow, experiment: captions}
      - {name: wandb, mode: offline}

The built-in hooks always run, first, in the fixed order of ``BUILTIN_HOOKS``; the listed ones follow in
list order. Every event reaches the hooks in that order.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Any

from omegaconf import OmegaConf

from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.runners.hooks.base import Hook, HookList

# Their order is their run order. Logging first: the records of an event are written before any hook acts on
# them. Validation and the benchmarks (lmms_eval) before the checkpoint hooks: a step's checkpoint is scored by
# that step's evaluations (the save itself waits for the whole dispatch anyway). The test generation: once, at the
# very end. The training clock last: the throughput clock restarts when the evaluations of a step are done.
BUILTIN_HOOKS = ("metrics_log", "validation", "lmms_eval", "checkpointer", "best_checkpoint", "test_generation",
                 "training_clock")


def build_hooks(trainer) -> HookList:
    """The built-in hooks, with their settings from `run`, then those of `run.hooks` (validated when the config
    was loaded)."""
    settings = builtin_settings(trainer.run)
    builtin = [hook_registry.get(name)(**settings.get(name, {})) for name in BUILTIN_HOOKS]
    listed = [hook_registry.get(name)(**options) for name, options in hook_specs(trainer.run.get("hooks"))]
    return HookList(trainer, builtin + listed)


def builtin_settings(run) -> dict[str, dict[str, Any]]:
    """The constructor arguments of each built-in hook, from the `run` section (a hook reads no `run` key itself)."""
    run = OmegaConf.to_container(run, resolve=True) if OmegaConf.is_config(run) else dict(run)
    return {
        "metrics_log": {"log_freq": run["log_freq"], "peak_tflops": run.get("peak_tflops"),
                        "precision": run.get("precision")},
        "validation": {"valid_splits": run["valid_splits"], "val_freq_steps": run["val_freq_steps"],
                       "val_metrics": run.get("val_metrics") or []},
        "lmms_eval": run.get("lmms_eval") or {},  # unset: the hook does nothing
        "checkpointer": {"save_freq_steps": run["save_freq_steps"]},
        "best_checkpoint": {"metric": run.get("best_metric"), "valid_splits": run["valid_splits"],
                            "keep_last": run["keep_last"]},
        "test_generation": {"test_splits": run["test_splits"], "test_metrics": run.get("test_metrics") or [],
                            "num_log_samples": run["num_log_samples"]},
    }


def hook_specs(hooks: Any) -> list[tuple[str, dict]]:
    """``[(name, options), ...]`` of a valid `run.hooks` list."""
    plain = OmegaConf.to_container(hooks, resolve=True) if OmegaConf.is_config(hooks) else hooks
    return [(item, {}) if isinstance(item, str) else (item["name"], {k: v for k, v in item.items() if k != "name"})
            for item in plain or []]


def hook_problems(hooks: Any) -> list[str]:
    """Every problem of a `run.hooks` value (plain, from YAML): shape, names, options, missing packages."""
    if not isinstance(hooks, list):
        return []  # not a list: the type check of `run` reports it
    problems, seen = [], set()
    for i, item in enumerate(hooks):
        where = f"run.hooks[{i}]"
        if not isinstance(item, (str, dict)):
            continue  # the type check of `run` reports it
        if isinstance(item, dict) and not isinstance(item.get("name"), str):
            problems.append(f"{where}.name: required key is missing; a hook is a registered name or a mapping "
                            f"with `name` and its options")
            continue
        name = item if isinstance(item, str) else item["name"]
        if name not in hook_registry:
            problems.append(f"{where}: {_unknown(name)}")
        elif hook_registry.canonical(name) in BUILTIN_HOOKS:
            problems.append(f"{where}: {name!r} is a built-in hook and always runs ({', '.join(BUILTIN_HOOKS)}, "
                            f"in that order); run.hooks lists the others")
        elif hook_registry.canonical(name) in seen:
            problems.append(f"{where}: {name!r} is listed twice")
        else:
            seen.add(hook_registry.canonical(name))
            problems += _option_problems(name, item if isinstance(item, dict) else {}, where)
    return problems


def _unknown(name: str) -> str:
    try:
        hook_registry.get(name)
    except KeyError as e:
        return e.args[0]
    return ""


def _option_problems(name: str, options: dict, where: str) -> list[str]:
    cls: type[Hook] = hook_registry.get(name)
    problems: list[str] = []
    check_section(options, fields_of(cls), where, problems, extra_keys=("name",))
    for module, package in cls.REQUIRES.items():
        if not _installed(module):
            problems.append(f"{where}: the {name!r} hook needs the Python package "
                            f"{module!r}, which is not installed; pip install {package} "
                            f"(or pip install 'lavis_ds[trackers]')")
    return problems


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (trackers take seconds to import)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
