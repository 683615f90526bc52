"""Load one run YAML: import user modules, merge defaults, apply --options, validate.

Order of precedence, lowest first: the model's default YAML for its `model_type`,
the dataset builder's default YAML, the `RunConfig` defaults, the user's YAML,
the `--options key=value` overrides. The merged config is checked as a whole
and every problem is reported in one `ConfigError`, each with its key path.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lavis_ds.common import registry as reg
from lavis_ds.common.run_config import LEGACY_RUN_KEYS, RunConfig, batch_sizes, deepspeed_problems
from lavis_ds.common.schema import check_section, fields_of, unknown_key_message
from lavis_ds.datasets.mixing import ratio_problems
from lavis_ds.datasets.builders import merge_section_defaults
from lavis_ds.metrics.selection import metric_problems
from lavis_ds.models.base import COMMON_KEYS as COMMON_MODEL_KEYS

TOP_LEVEL_KEYS = ("imports", "model", "datasets", "run")


class ConfigError(ValueError):
    """Every problem found in a run config, one per line."""

    def __init__(self, problems: Iterable[str], source: str = "config"):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n" +
                         "\n".join(f"  - {p}" for p in self.problems))


def load_config(cfg_path: str | os.PathLike, options: Iterable[str] = (), world_size: int = 1,
                check_files: bool = True) -> DictConfig:
    """Read, merge and validate a run config. Raises `ConfigError` listing every problem.

    Data that a builder generates on first use (the demo) is prepared after the
    structure is valid and before file paths are checked. ``check_files=False``
    checks the structure only (for YAMLs whose weights live on another machine).
    """
    source = str(cfg_path)
    user = _read_yaml(cfg_path, source)
    try:
        user = OmegaConf.merge(user, OmegaConf.from_dotlist(list(options)))
    except OmegaConfBaseException as e:
        raise ConfigError([f"--options {' '.join(options)}: {e}"], source) from None
    import_user_modules(user.get("imports") or [], source)

    errors: list[str] = []
    cfg = _merge_defaults(user, errors)
    if not errors:
        try:
            OmegaConf.resolve(cfg)
            cfg = _expand_home(cfg)
        except OmegaConfBaseException as e:
            errors.append(f"interpolation: {e}")
    if not errors:
        validate(cfg, errors, world_size)
    if errors:
        raise ConfigError(errors, source)
    if not check_files:
        return cfg

    builders = {name: reg.builders.get(section.get("builder", name))(section)
                for name, section in cfg.datasets.items()}
    for builder in builders.values():
        builder.prepare()
    errors = [problem for builder in builders.values() for problem in builder.check()]
    errors += _missing_model_files(cfg.model)
    if errors:
        raise ConfigError(errors, source)
    return cfg


def import_user_modules(modules: Iterable[str], source: str = "config") -> None:
    """Import the modules named under `imports:` so their registrations take effect."""
    # Like `python -m`, look in the working directory first: user packages live beside the YAMLs.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    errors = []
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure inside the user's module belongs in the report
            errors.append(f"imports[{i}]: cannot import {name!r}: {type(e).__name__}: {e}")
    if errors:
        raise ConfigError(errors, source)


def _read_yaml(path: str | os.PathLike, source: str) -> DictConfig:
    if not Path(path).is_file():
        raise ConfigError([f"{path}: config file not found"], source)
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"], source) from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError([f"{path}: the top level must be a mapping with keys {', '.join(TOP_LEVEL_KEYS)}"], source)
    return cfg


def _merge_defaults(user: DictConfig, errors: list[str]) -> DictConfig:
    """Put each component's defaults under the user's sections."""
    for key in user:
        if key not in TOP_LEVEL_KEYS:
            errors.append(unknown_key_message("<top level>", str(key), TOP_LEVEL_KEYS))
    for key in ("model", "datasets", "run"):
        if not isinstance(user.get(key), DictConfig):
            errors.append(f"{key}: required section is missing (or not a mapping)")
    if errors:
        return user

    model = user.model
    if "arch" not in model:
        errors.append("model.arch: required key is missing; known models: " + ", ".join(reg.models))
        model_defaults = {}
    elif model.arch not in reg.models:
        errors.append(f"model.arch: {_lookup_error(reg.models, model.arch)}")
        model_defaults = {}
    else:
        cls = reg.models.get(model.arch)
        model_type = model.get("model_type") or next(iter(cls.PRETRAINED_MODEL_CONFIG_DICT))
        try:
            model_defaults = OmegaConf.load(cls.default_config_path(model_type)).model
        except KeyError as e:
            errors.append(f"model.model_type: {e.args[0]}")
            model_defaults = {}

    datasets = {}
    for name, section in user.datasets.items():
        builder_name = section.get("builder", name) if isinstance(section, DictConfig) else name
        if builder_name not in reg.builders:
            errors.append(f"datasets.{name}: {_lookup_error(reg.builders, builder_name)}")
            datasets[name] = section
            continue
        default_path = reg.builders.get(builder_name).default_config_path()
        defaults = OmegaConf.load(default_path).datasets.get(builder_name, {}) if default_path else OmegaConf.create()
        datasets[name] = merge_section_defaults(defaults, section)

    run_defaults = {k: v for k, (_, v) in fields_of(RunConfig).items() if k != "output_dir"}
    return OmegaConf.create({
        **({"imports": user.imports} if "imports" in user else {}),
        "model": OmegaConf.merge(model_defaults, model),
        "datasets": datasets,
        "run": OmegaConf.merge(run_defaults, user.run),
    })


def _expand_home(cfg: DictConfig) -> DictConfig:
    """`~/x` means the home folder in every path value, as it does in a shell."""
    def expand(node):
        if isinstance(node, dict):
            return {k: expand(v) for k, v in node.items()}
        if isinstance(node, list):
            return [expand(v) for v in node]
        return os.path.expanduser(node) if isinstance(node, str) and node.startswith("~") else node
    return OmegaConf.create(expand(OmegaConf.to_container(cfg)))


def _lookup_error(registry: reg.Registry, name: str) -> str:
    try:
        registry.get(name)
    except KeyError as e:
        return e.args[0]
    return ""


def validate(cfg: DictConfig, errors: list[str], world_size: int = 1) -> None:
    """Append every problem of a merged config to ``errors``."""
    plain = OmegaConf.to_container(cfg, resolve=True)

    model = plain["model"]
    cls = reg.models.get(model["arch"])
    check_section(model, fields_of(cls), "model", errors, extra_keys=COMMON_MODEL_KEYS)

    if not plain["datasets"]:
        errors.append("datasets: no dataset configured")
    for name, section in plain["datasets"].items():
        _check_dataset(name, section, errors)

    run = plain["run"]
    check_section(run, fields_of(RunConfig), "run", errors, extra_keys=LEGACY_RUN_KEYS)
    training = {name: section for name, section in plain["datasets"].items()
                if isinstance(section, dict) and _trains(section, run.get("train_splits") or [])}
    errors.extend(ratio_problems({name: section.get("sample_ratio") for name, section in training.items()}))
    errors.extend(_image_size_problems(training))
    errors.extend(_model_image_size_problems(plain["datasets"], plain["model"]))
    for key, registry in (("runner", reg.runners), ("lr_sched", reg.lr_schedulers)):
        if isinstance(run.get(key), str) and run[key] not in registry:
            errors.append(f"run.{key}: {_lookup_error(registry, run[key])}")
    ds = run.get("deepspeed_config") or {}
    if isinstance(ds, dict):
        errors.extend(deepspeed_problems(ds))
        try:
            batch_sizes(run, world_size)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    # Split names are known only for datasets that list annotation files (generated ones have their own).
    annotations = [(section.get("build_info") or {}).get("annotations") for section in plain["datasets"].values()
                   if isinstance(section, dict)]
    splits = {s for a in annotations if a for s in a} if all(annotations) else set()
    for key in ("train_splits", "valid_splits", "test_splits"):
        for split in run.get(key) or []:
            if splits and split not in splits:
                errors.append(f"run.{key}: split {split!r} is not in any dataset; available: {', '.join(sorted(splits))}")
    errors.extend(metric_problems(run, plain["datasets"]))
    keep_last = run.get("keep_last")
    if isinstance(keep_last, int) and keep_last < 0:
        errors.append(f"run.keep_last: expected 0 (keep every checkpoint) or a positive count, got {keep_last}")
    resume = run.get("resume")
    if not (resume in ("auto", False, None) or (isinstance(resume, str) and resume)):
        errors.append(f"run.resume: expected 'auto', false or a checkpoint path, got {resume!r}")
    elif isinstance(resume, str) and resume != "auto" and not Path(resume).is_dir():
        errors.append(f"run.resume: checkpoint folder {resume!r} does not exist")


def _check_dataset(name: str, section: dict, errors: list[str]) -> None:
    path = f"datasets.{name}"
    if not isinstance(section, dict):
        errors.append(f"{path}: expected a mapping, got {section!r}")
        return
    builder = section.get("builder", name)
    cls = reg.builders.get(builder) if builder in reg.builders else None  # unknown: _merge_defaults says so
    if hasattr(cls, "section_problems"):
        errors.extend(cls.section_problems(section, path))
    for kind in ("vis_processor", "text_processor"):
        for split, proc in (section.get(kind) or {}).items():
            where = f"{path}.{kind}.{split}"
            if split not in ("train", "eval"):
                errors.append(unknown_key_message(f"{path}.{kind}", split, ("train", "eval")))
            elif not isinstance(proc, dict) or "name" not in proc:
                errors.append(f"{where}.name: required key is missing; known processors: {', '.join(reg.processors)}")
            elif proc["name"] not in reg.processors:
                errors.append(f"{where}.name: {_lookup_error(reg.processors, proc['name'])}")
            else:
                check_section(proc, fields_of(reg.processors.get(proc["name"])), where, errors, extra_keys=("name",))


def _trains(section: dict, train_splits: list) -> bool:
    """Whether a dataset section contributes to training (generated data without `annotations`: assume so)."""
    annotations = (section.get("build_info") or {}).get("annotations")
    return not isinstance(annotations, dict) or any(split in annotations for split in train_splits)


def _image_size_problems(training: dict[str, dict]) -> list[str]:
    """Training batches stack the images of every training dataset: they must have one size."""
    sizes = {}
    for name, section in training.items():
        proc = (section.get("vis_processor") or {}).get("train")
        known = isinstance(proc, dict) and proc.get("name") in reg.processors
        fields = fields_of(reg.processors.get(proc["name"])) if known else {}
        if "image_size" in fields:  # a processor without the argument says nothing about the size
            sizes[name] = proc.get("image_size", fields["image_size"][1])
    first = next(iter(sizes), None)
    return [f"datasets.{name}.vis_processor.train.image_size: {size} differs from datasets.{first}'s "
            f"{sizes[first]}; datasets that train together must make images of one size (a batch mixes them)"
            for name, size in sizes.items() if size != sizes[first]]


def _model_image_size_problems(datasets: dict, model: dict) -> list[str]:
    """Every image processor must make the size the vision tower is built for (its position embedding)."""
    expected = model.get("image_size")
    if not isinstance(expected, int):
        return []
    problems = []
    for name, section in datasets.items():
        processors = (section.get("vis_processor") or {}) if isinstance(section, dict) else {}
        for stage, proc in processors.items():
            known = isinstance(proc, dict) and proc.get("name") in reg.processors
            fields = fields_of(reg.processors.get(proc["name"])) if known else {}
            size = proc.get("image_size", fields["image_size"][1]) if "image_size" in fields else expected
            if size != expected:
                problems.append(f"datasets.{name}.vis_processor.{stage}.image_size: {size} but model.image_size is "
                                f"{expected}; the vision tower takes images of model.image_size only")
    return problems


def _missing_model_files(model: DictConfig) -> list[str]:
    """Local files and folders the model reads (weights, tokenizer) must exist before any rank starts loading."""
    # vit_pretrained is loaded whatever load_pretrained says (LAVIS always loads eva_vit_g.pth).
    keys = ["tokenizer", "llm_model", "vit_pretrained"] + (["pretrained"] if model.get("load_pretrained") else [])
    return [f"model.{key}: {model[key]!r} does not exist" for key in keys
            if model.get(key) and not Path(os.path.expanduser(model[key])).exists()]
