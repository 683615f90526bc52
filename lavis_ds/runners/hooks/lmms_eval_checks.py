"""`run.lmms_eval`: its schema, the names its scores are logged under, and its config check.

An lmms-eval result row ``results[task]["<metric>,<filter>"]`` is logged in the evaluation record of split
``lmms_eval`` as ``<task>/<metric>`` (the filter ``none``, lmms-eval's default) or ``<task>/<filter>/<metric>``;
trackers show it, and ``run.best_metric`` names it, as ``lmms_eval/<task>/<metric>`` (docs/evaluation.md). The
config check reads the tasks' YAML through lmms-eval's own ``TaskManager`` (the task index takes seconds to build:
it is built only for a config that sets `run.lmms_eval`, once per process and include path).
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from lavis_ds.common.run_config import AtLeastOne, NonNegative
from lavis_ds.common.schema import Range, check_section, fields_of
from lavis_ds.common.suggest import did_you_mean
from lavis_ds.metrics.selection import LMMS_EVAL_SPLIT as SPLIT  # its records' split: scores are lmms_eval/<key>
from lavis_ds.common.errors import InputError
from lavis_ds.runners.lmms_eval import INSTALL_LINE
from lavis_ds.runners.lmms_eval.tasks import check_datasets_on_disk, task_manager

DEFAULT_FILTER = "none"  # lmms-eval's name for "no filter": left out of the logged names


@dataclass(frozen=True)
class LmmsEvalSettings:
    """Schema of `run.lmms_eval`; the hook's constructor takes these keys."""

    tasks: list[str]  # lmms-eval task (or group) names
    every: int | Literal["epoch"] = "epoch"  # evaluate every N optimizer steps, or at every epoch end
    limit: Annotated[int | float | None, Range(gt=0)] = None  # documents per task (a fraction below 1); unset: all
    num_fewshot: Annotated[int | None, NonNegative] = None  # unset: each task's own
    batch_size: Annotated[int, AtLeastOne] = 1  # requests per generate/forward call of the model
    include_path: str | None = None  # a folder of the user's own task YAMLs (local copies of benchmarks)
    on_error: Literal["stop", "continue"] = "stop"  # an evaluation failing on any rank stops every rank, or is skipped


def log_name(task: str, result_key: str) -> str | None:
    """The logged name of lmms-eval's ``<metric>,<filter>`` result key of ``task`` (None: not a score key)."""
    if "," not in result_key:
        return None  # "alias", "samples", ...
    metric, filter_name = result_key.split(",", 1)
    return f"{task}/{metric}" if filter_name == DEFAULT_FILTER else f"{task}/{filter_name}/{metric}"


def scores_of(results: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, bool]]:
    """The numeric scores of ``simple_evaluate``'s results under their logged names, and each metric's direction
    (lmms-eval's ``higher_is_better``) under the name ``run.best_metric`` gives it."""
    scores, directions = {}, {}
    for task, row in results.get("results", {}).items():
        higher = results.get("higher_is_better", {}).get(task, {})
        for key, value in row.items():
            name = log_name(task, key)
            if name is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # stderr is "N/A" when lmms-eval computed none
            scores[name] = float(value)
            metric = key.split(",", 1)[0]
            if metric in higher:
                directions[f"{SPLIT}/{name}"] = bool(higher[metric])
    return scores, directions


def lmms_eval_installed() -> bool:
    """Whether lmms-eval can be imported, without importing it (seconds)."""
    if "lmms_eval" in sys.modules:
        return sys.modules["lmms_eval"] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec("lmms_eval") is not None
    except (ImportError, ValueError):
        return False


def lmms_eval_problems(run: Mapping[str, Any]) -> list[str]:
    """Every problem of `run.lmms_eval` (plain, from YAML) and of a `run.best_metric` that names one of its scores."""
    section, best = run.get("lmms_eval"), run.get("best_metric")
    names_lmms = isinstance(best, str) and best.startswith(f"{SPLIT}/")
    if section is None:
        return [f"run.best_metric: {best!r} names an lmms-eval score, and run.lmms_eval is not set; set "
                f"run.lmms_eval: {{tasks: [...]}} or choose a validation metric"] if names_lmms else []
    if not isinstance(section, dict):
        return []  # the type check of `run` reports it
    problems: list[str] = []
    check_section(section, fields_of(LmmsEvalSettings), "run.lmms_eval", problems)
    every = section.get("every")
    if isinstance(every, int) and not isinstance(every, bool) and every < 1:  # another type: check_section says so
        problems.append(f"run.lmms_eval.every: expected a number of optimizer steps (>= 1) or 'epoch', got {every}")
    tasks = section.get("tasks")
    if isinstance(tasks, list) and not tasks:
        problems.append("run.lmms_eval.tasks: no task named; list lmms-eval task names, e.g. [mmbench_en_dev]")
    include = section.get("include_path")
    if isinstance(include, str) and not Path(include).expanduser().is_dir():
        problems.append(f"run.lmms_eval.include_path: folder {include!r} does not exist (it holds task YAMLs)")
    if not lmms_eval_installed():
        return problems + [f"run.lmms_eval: evaluating on lmms-eval tasks needs lmms-eval, which is not installed; "
                           f"{INSTALL_LINE}"]
    if not (tasks and isinstance(tasks, list) and all(isinstance(t, str) for t in tasks)) or any(
            p.startswith("run.lmms_eval.include_path") for p in problems):
        return problems  # the tasks cannot be looked up: what is wrong with them or the folder is reported
    return problems + _task_problems(tasks, include, best if names_lmms else None)


def _task_problems(tasks: list[str], include: str | None, best: str | None) -> list[str]:
    """Unknown task names; else a local dataset that is not on disk; else a ``best`` no task scores."""
    index = task_index(str(Path(include).expanduser()) if include else None, tuple(tasks))
    matched = index.match_tasks(tasks)  # names and wildcards, as lmms-eval resolves them
    unknown = [(i, task) for i, task in enumerate(tasks) if task not in matched and "*" not in task]
    if unknown:
        return [f"run.lmms_eval.tasks[{i}]: {task!r} is not an lmms-eval task or group; "
                f"{did_you_mean(task, index.all_tasks, 'see lmms-eval --tasks list', n=3)}"
                f"{'' if include else ' (a task of your own: set run.lmms_eval.include_path)'}" for i, task in unknown]
    try:  # a local dataset that is not there fails the first evaluation, maybe hours into the run: say so now
        check_datasets_on_disk(matched, index)
    except InputError as e:
        return [f"run.lmms_eval.tasks: {e}"]
    logged = [f"{SPLIT}/{name}" for task in matched for name in task_metric_names(index, task)]
    if best is not None and best not in logged:
        return [f"run.best_metric: {best!r} is not a score of the tasks of run.lmms_eval; choose one of: "
                f"{', '.join(logged) or '(their YAMLs name no metric_list)'}"]
    return []


def task_index(include_path: str | None, tasks: tuple[str, ...] = ()):
    """lmms-eval's ``TaskManager`` that knows ``tasks`` (``lmms_eval.tasks.task_manager``: over ``include_path``
    alone when it holds every one, else over lmms-eval's own tasks too), once per process: the config check and the
    hook share it. Without ``include_path`` it is the index of lmms-eval's own tasks, whatever ``tasks`` are."""
    return _task_manager(include_path, tuple(tasks) if include_path else ())


@functools.lru_cache(maxsize=4)  # indexing lmms-eval's own tasks takes seconds
def _task_manager(include_path: str | None, tasks: tuple[str, ...]):
    return task_manager(include_path, tasks)


def task_metric_names(index, name: str) -> list[str]:
    """The logged names (``<task>/<metric>``) of the scores a task, or every task of a group, gives."""
    entry = index.task_index.get(name, {})
    if entry.get("type") == "tag":  # a tag names its tasks in the index, and has no YAML of its own
        return [n for member in entry.get("task", []) for n in task_metric_names(index, member)]
    config = index._get_config(name)  # lmms-eval's own YAML reader (includes resolved)
    if entry.get("type") == "group" or isinstance(config.get("task"), list):
        members = [t if isinstance(t, str) else t.get("task") for t in config.get("task", [])]
        aggregate = [m["metric"] for m in config.get("aggregate_metric_list") or [] if "metric" in m]
        return [f"{name}/{m}" for m in aggregate] + [n for member in members if isinstance(member, str)
                                                     for n in task_metric_names(index, member)]
    filters = [f["name"] for f in config.get("filter_list") or [] if "name" in f] or [DEFAULT_FILTER]
    metrics = [m["metric"] for m in config.get("metric_list") or [] if isinstance(m.get("metric"), str)]
    return [log_name(name, f"{metric},{filter_name}") for metric in metrics for filter_name in filters]
