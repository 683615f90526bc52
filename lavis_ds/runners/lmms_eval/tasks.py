"""lmms-eval's tasks, checked before a model is loaded: every name known, every local dataset on disk, and offline
every hub dataset in the datasets cache.

An lmms-eval task names its dataset by ``dataset_path``: a Hugging Face hub id (downloaded into the datasets cache
on first use), a local folder, or one of ``datasets``' file builders (``json``, ``parquet``, ``csv``, ...) with
``dataset_kwargs.data_files`` (paths relative to the task's YAML file). Imports lmms-eval (only where an evaluation
is asked for).
"""
from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any, Iterable

from lavis_ds.common.errors import InputError
from lavis_ds.common.suggest import closest

LOCAL_BUILDERS = frozenset({"csv", "json", "parquet", "text", "pandas", "arrow"})  # lmms-eval's utils._LOCAL_BUILDERS
HUB_PREFIX = "hf://datasets/"  # a dataset_path that names a hub repository explicitly
TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})  # what datasets and huggingface_hub read as an enabled variable


def task_manager(include_path: str | list[str] | None = None, names: Iterable[str] = ()):
    """lmms-eval's ``TaskManager`` over the tasks under ``include_path`` (folders of task YAMLs) when they hold every
    one of ``names``, else over lmms-eval's own tasks too (indexing its few hundred task folders takes seconds)."""
    from lmms_eval.tasks import TaskManager

    paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
    missing = [p for p in paths if not Path(p).is_dir()]
    if missing:
        raise InputError(f"--include_path {missing[0]}: not a folder (a folder of lmms-eval task YAML files)")
    names = list(names)
    if paths and names:
        local = TaskManager("WARNING", include_path=paths, include_defaults=False)
        if all(name in local.match_tasks([name]) for name in names):
            return local
    return TaskManager("WARNING", include_path=paths or None)


def check_task_names(names: Iterable[str], manager) -> list[str]:
    """``names`` (wildcards allowed) as the tasks lmms-eval knows; an unknown one raises one ``InputError`` with
    the closest known names."""
    names = list(names)
    matched = manager.match_tasks(names)
    unknown = [name for name in names if name not in matched and "*" not in name]
    if unknown:
        hints = [f"{name!r} (closest: {', '.join(closest(name, manager.all_tasks, n=3)) or 'none'})"
                 for name in unknown]
        raise InputError(f"unknown lmms-eval task {'; '.join(hints)}; `lmms-eval --tasks list` lists the "
                         f"{len(manager.all_tasks)} it knows, and --include_path adds a folder of task YAMLs")
    return matched


def check_datasets_on_disk(names: Iterable[str], manager) -> None:
    """Raise one ``InputError`` for the first task whose local dataset files are missing, naming the path it read."""
    for name in names:
        for task, config in _task_configs(name, manager):
            problem = dataset_problem(config)
            if problem is not None:
                yaml = manager.task_index.get(task, {}).get("yaml_path", "?")
                raise InputError(f"task {task} ({yaml}): {problem}")


def _task_configs(name: str, manager) -> list[tuple[str, dict[str, Any]]]:
    """``(task, YAML config)`` of ``name`` and, for a group or tag, of the tasks it holds."""
    entry = manager.task_index.get(name)
    if entry is None:
        return []
    if entry["type"] == "task":
        return [(name, manager._get_config(name))]  # lmms-eval's own reader: includes resolved, data_files anchored
    if entry["type"] in ("group", "tag"):
        members = manager._get_tasklist(name) if entry["type"] == "group" else entry.get("task", [])
        return [pair for member in members if isinstance(member, str) for pair in _task_configs(member, manager)]
    return []


def dataset_problem(config: dict[str, Any]) -> str | None:
    """Why a task's dataset is not where its YAML says (None: it is, or it is a hub id that can still be downloaded,
    or that the datasets cache holds: a failed download is reported when it loads, :func:`hub_dataset_error`)."""
    path = config.get("dataset_path")
    kwargs = config.get("dataset_kwargs") or {}
    if not isinstance(path, str):
        return None
    if _is_hub_id(path):
        return _offline_hub_problem(path.removeprefix(HUB_PREFIX), kwargs)
    if path in LOCAL_BUILDERS:
        files = kwargs.get("data_files")
        if files is None:
            return f"dataset_path: {path} needs dataset_kwargs.data_files (the {path} files of the dataset)"
        missing = [f for f in _paths(files) if not glob.glob(os.path.expanduser(f))]
        if missing:
            return (f"dataset file {missing[0]} is not on disk (dataset_kwargs.data_files; a relative path is read "
                    "beside the task's YAML file): copy the dataset there or point data_files at it")
        return None
    if kwargs.get("load_from_disk") and not Path(path).expanduser().exists():
        return f"dataset folder {path} is not on disk (dataset_path with dataset_kwargs.load_from_disk: true)"
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():  # a folder, not a hub id
        return f"dataset folder {path} is not on disk (dataset_path)"
    return None


def _is_hub_id(path: str) -> bool:
    """Whether ``datasets.load_dataset`` reads ``path`` as a dataset repository on the hub (``namespace/name`` or
    ``name``, not a local folder, not one of its file builders; ``datasets.load.dataset_module_factory``)."""
    if path.startswith(HUB_PREFIX):
        return path.removeprefix(HUB_PREFIX).count("/") <= 1
    return (path not in LOCAL_BUILDERS and path.count("/") <= 1 and not path.startswith((".", "/", "~"))
            and not Path(path).expanduser().exists())


def offline_variable() -> str | None:
    """The variable that keeps ``datasets`` off the network (``HF_DATASETS_OFFLINE``, else ``HF_HUB_OFFLINE`` or
    ``TRANSFORMERS_OFFLINE``: datasets/config.py's rule), None when it may download. Read from the environment the
    evaluation runs in, as ``datasets`` reads it when lmms-eval's processes import it."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value is not None and (name == "HF_DATASETS_OFFLINE" or value):
            return name if value.upper() in TRUE_VALUES else None
    return None


def _offline_hub_problem(repo_id: str, kwargs: dict[str, Any]) -> str | None:
    """Why an offline ``load_dataset`` of hub dataset ``repo_id`` would fail (None: it is cached, or may download).

    Offline, ``datasets`` goes straight to the copy a previous load left in the datasets cache (its
    ``CachedDatasetModuleFactory``, asked here); without one, lmms-eval retries the load for up to a minute before
    its error. lmms-eval loads into ``dataset_kwargs.cache_dir`` when the task sets one (and it is not a video
    task's, where that names the videos' folder), else into its own datasets cache."""
    variable = offline_variable()
    if variable is None:
        return None
    try:
        from datasets.load import CachedDatasetModuleFactory
    except ImportError:  # a datasets release without it: the load itself says what is missing
        return None
    from lmms_eval.api.task import _resolve_hf_datasets_cache_dir

    cache = kwargs.get("cache_dir") if not kwargs.get("video") else None
    cache = os.path.expanduser(str(cache or _resolve_hf_datasets_cache_dir()))
    quiet = logging.getLogger("datasets.load")  # it tells of the cached copy it found: the load says so again
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        CachedDatasetModuleFactory(repo_id, cache_dir=cache).get_module()
        return None
    except FileNotFoundError:
        return (f"dataset {repo_id} (dataset_path, a Hugging Face hub dataset) is not in the datasets cache {cache}, "
                f"and {variable}={os.environ[variable]} forbids downloading it: load the task once where there is a "
                "network (into the same cache), or point the task at a local copy (docs/evaluation.md)")
    finally:
        quiet.setLevel(level)


def _paths(files: Any) -> list[str]:
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [p for value in files.values() for p in _paths(value)]
    if isinstance(files, (list, tuple)):
        return [p for value in files for p in _paths(value)]
    return []


def hub_dataset_error(error: BaseException, tasks: list[str], manager) -> InputError | None:
    """One ``InputError`` for a hub dataset that is neither in the datasets cache nor downloadable (offline), naming
    each hub ``dataset_path`` of ``tasks`` and the cache folder; None for any other error."""
    kinds = {"ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError",
             "ConnectTimeout", "MaxRetryError", "HfHubHTTPError"}
    chain, seen = [], error
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    found = next((e for e in chain if type(e).__name__ in kinds), None)
    if found is None:
        return None
    hub = sorted({str(config.get("dataset_path")) for name in tasks for _, config in _task_configs(name, manager)
                  if config.get("dataset_path") and config.get("dataset_path") not in LOCAL_BUILDERS})
    from lmms_eval.api.task import _resolve_hf_datasets_cache_dir

    reason = str(found).splitlines()[0] if str(found) else ""
    return InputError(f"dataset {', '.join(hub) or '?'} is not on disk (datasets cache "
                      f"{_resolve_hf_datasets_cache_dir()}) and could not be downloaded ({type(found).__name__}: "
                      f"{reason}); download it where there is a network, or point the task at a local copy "
                      "(docs/evaluation.md)")
