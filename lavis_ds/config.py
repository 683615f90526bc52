"""Load one run YAML: import user modules, merge defaults, apply --options, validate.

Order of precedence, lowest first: the model's default YAML for its `model_type`,
the dataset builder's default YAML, the `RunConfig` defaults, the user's YAML,
the `--options key=value` overrides. LAVIS / MiniGPT4Qwen keys are translated
first (`lavis_compat`), and each runner's options section is read by its runner (e.g. a
DeepSpeed JSON file named by its path). What a runner's section says about the engine-neutral
run keys (batch, precision, clipping, AdamW's betas/eps: its "twins") is mapped onto those keys
whichever runner the run chose, so switching `run.runner` keeps them. The merged config is checked as a
whole and every problem is reported in one `ConfigError`, each with its key path:
an unknown name (arch, model_type, builder, runner, hook) is reported with the rest,
which is checked against the closest known name.

It lives beside the build step (``lavis_ds.build``), above ``common/``: checking a config asks the
registered models, builders, metrics and runners about their own sections.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lavis_ds.common import dist, lavis_compat
from lavis_ds.common import registry as reg
from lavis_ds.common.errors import ConfigError
from lavis_ds.common.run_config import (NEUTRAL_KEYS, RunConfig, Twin, batch_unit, resolve_twins, training_settings,
                                       valid_betas)
from lavis_ds.common.schema import check_section, fields_of, unknown_key_message
from lavis_ds.datasets.builders import BaseDatasetBuilder, merge_section_defaults
from lavis_ds.datasets.loading import ParsedFiles
from lavis_ds.datasets.mixing import ratio_problems
from lavis_ds.metrics.selection import metric_problems
from lavis_ds.models.base import COMMON_KEYS as COMMON_MODEL_KEYS
from lavis_ds.objectives.config import data_problems, objective_problems, option_section_keys
from lavis_ds.runners import DEFAULT_RUNNER
from lavis_ds.runners.hooks import hook_problems

logger = logging.getLogger(__name__)

TOP_LEVEL_KEYS = ("imports", "model", "datasets", "run")



def load_config(cfg_path: str | os.PathLike, options: Iterable[str] = (), world_size: int = 1,
                check_files: bool = True, parsed_files: ParsedFiles | None = None) -> DictConfig:
    """Read, merge and validate a run config. Raises `ConfigError` listing every problem.

    Data that a builder generates on first use (the demo) is prepared after the
    structure is valid and before file paths are checked. ``check_files=False``
    checks the structure only (for YAMLs whose weights live on another machine).
    ``parsed_files`` keeps the annotation files the check parsed, for the build to use.
    """
    source = str(cfg_path)
    user = _read_yaml(cfg_path, source)
    bare = [option for option in options if "=" not in option]
    if bare:  # OmegaConf would set them to null, then reported as a wrong type ("expected int, got None")
        raise ConfigError([f"--options {option}: no '=value'; write {option}=<value> (or {option}=null to unset it)"
                           for option in bare], source)
    try:
        user = OmegaConf.merge(user, OmegaConf.from_dotlist(list(options)))
    except OmegaConfBaseException as e:
        raise ConfigError([f"--options {' '.join(options)}: {e}"], source) from None
    import_user_modules(user.get("imports") or [], source)

    errors: list[str] = []
    user, notes = _translate(user, errors)
    cfg = _merge_defaults(user, errors)
    if cfg is None:  # no model/datasets/run mappings: nothing further can be checked
        raise ConfigError(errors, source)
    try:
        OmegaConf.resolve(cfg)
        cfg = _expand_home(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(errors + [f"interpolation: {e}"], source) from None
    neutral = validate(cfg, errors, world_size)
    if not errors:
        # The neutral keys as resolved with their twins; then the engine completes its section as it will use it
        # (DeepSpeed: autos filled, batch layout). config.yaml records both.
        runner = reg.runners.get(cfg.run.runner)
        run, runner_notes = runner.complete_config({**OmegaConf.to_container(cfg.run), **neutral}, world_size)
        cfg.run = OmegaConf.create(run)
        runner_notes += _foreign_options_notes(run, runner)
        if dist.is_main_process():  # every rank loads the config; one says what it did
            for line in notes + runner_notes:
                logger.warning("%s", line)
    if check_files:  # files too, for every section whose structure is sound: all problems in one round
        errors += _file_problems(cfg, errors, parsed_files)
    if errors:
        raise ConfigError(errors, source)
    return cfg


def _file_problems(cfg: DictConfig, structural: list[str], parsed_files: ParsedFiles | None) -> list[str]:
    """Missing or bad data and model files. Sections with structural problems are skipped (their
    builder could not be trusted to read them); data a builder generates is prepared first."""
    problems = []
    for name, section in cfg.datasets.items():
        builder_name = section.get("builder", name) if isinstance(section, DictConfig) else None
        if builder_name not in reg.builders or any(p.startswith((f"datasets.{name}.", f"datasets.{name}:"))
                                                   for p in structural):
            continue
        try:
            builder = reg.builders.get(builder_name)(section, parsed_files=parsed_files)
            builder.prepare()
            problems += builder.check()
        except (OSError, ValueError) as e:
            problems.append(f"datasets.{name}: {e}")
    return problems + _missing_model_files(cfg.model, model_class(cfg.model.get("arch")))


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


def _translate(user: DictConfig, errors: list[str]) -> tuple[DictConfig, list[str]]:
    """Let each runner read its options section (e.g. a DeepSpeed JSON file's path), then map the LAVIS keys."""
    plain = OmegaConf.to_container(user, resolve=False)
    run = plain.get("run")
    if isinstance(run, dict):
        for runner in _runners().values():
            if runner.OPTIONS_KEY in run:
                section, problems = runner.read_options(run[runner.OPTIONS_KEY])
                errors.extend(problems)
                if section is not None:
                    run[runner.OPTIONS_KEY] = section
    twins, _ = option_twins(run) if isinstance(run, dict) else ([], [])  # their problems: reported by validate
    problems, notes = lavis_compat.translate(plain, twins)
    errors.extend(problems)
    return OmegaConf.create(plain), notes


def _runners() -> dict[str, type]:
    """Every registered runner class once, by its name (a user's subclass may share its parent's options section)."""
    return reg.runners.distinct()


def option_twins(run: dict) -> tuple[list[Twin], list[str]]:
    """What the runners' options sections of ``run`` say about the neutral run keys, and problems with it."""
    twins, problems, seen = [], [], set()
    for runner in _runners().values():
        key = runner.OPTIONS_KEY
        if key is None or key in seen or not isinstance(run.get(key), dict):
            continue
        seen.add(key)
        more_twins, more_problems = runner.option_twins(run[key])
        twins += more_twins
        problems += more_problems
    return twins, problems


def _foreign_options_notes(run: dict, chosen: type) -> list[str]:
    """Another runner's options section in this run: what of it this runner uses (its twins of the run keys)."""
    notes = []
    for name, runner in _runners().items():
        key = runner.OPTIONS_KEY
        if key is None or key == chosen.OPTIONS_KEY or not isinstance(run.get(key), dict) or not run[key]:
            continue
        used = {twin.path.split(".")[2] for twin in runner.option_twins(run[key])[0]}
        unused = sorted(k for k in run[key] if k not in used)
        if unused:
            notes.append(f"run.{key} is {name}'s section; {reg.runners.canonical(run['runner'])} reads only what it "
                         f"says about the run keys (batch, clipping, precision, AdamW's betas/eps); not used: "
                         f"{', '.join(unused)}")
    return notes


def model_class(arch: object) -> type | None:
    """The registered class of ``arch``, else the closest registered one (to check the rest against), else None."""
    if isinstance(arch, str) and arch in reg.models:
        return reg.models.get(arch)
    close = reg.models.closest(str(arch)) if arch is not None else None
    return reg.models.get(close) if close else None


def builder_class(name: object) -> type:
    """The registered builder ``name``, else the closest one, else the generic builder (its layout is shared)."""
    if isinstance(name, str) and name in reg.builders:
        return reg.builders.get(name)
    close = reg.builders.closest(str(name))
    return reg.builders.get(close) if close else BaseDatasetBuilder


def _merge_defaults(user: DictConfig, errors: list[str]) -> DictConfig | None:
    """Put each component's defaults under the user's sections (None if the sections are not there at all)."""
    for key in user:
        if key not in TOP_LEVEL_KEYS:
            errors.append(unknown_key_message("<top level>", str(key), TOP_LEVEL_KEYS))
    missing = [key for key in ("model", "datasets", "run") if not isinstance(user.get(key), DictConfig)]
    errors.extend(f"{key}: required section is missing (or not a mapping)" for key in missing)
    if missing:
        return None

    model = user.model
    cls = model_class(model.get("arch"))
    if "arch" not in model:
        errors.append("model.arch: required key is missing; known models: " + ", ".join(reg.models))
    elif model.arch not in reg.models:
        errors.append(f"model.arch: {_lookup_error(reg.models, model.arch)}")
    model_defaults = OmegaConf.create({})
    if cls is not None and cls.PRETRAINED_MODEL_CONFIG_DICT:
        model_type = model.get("model_type") or next(iter(cls.PRETRAINED_MODEL_CONFIG_DICT))
        try:
            model_defaults = OmegaConf.load(cls.default_config_path(model_type)).model
        except KeyError as e:
            # No preset's values: the user's keys are still checked against the class (a guessed preset's
            # values would be checked against the user's data, e.g. image sizes, and mislead).
            errors.append(f"model.model_type: {e.args[0]}")

    datasets = {}
    for name, section in user.datasets.items():
        builder_name = section.get("builder", name) if isinstance(section, DictConfig) else name
        if builder_name not in reg.builders:
            errors.append(f"datasets.{name}: {_lookup_error(reg.builders, builder_name)}")
        if not isinstance(section, DictConfig):
            datasets[name] = section
            continue
        # An unknown builder: its section is merged over the closest one's defaults and checked on.
        defaults = builder_class(builder_name).default_config()
        datasets[name] = merge_section_defaults(defaults, section)

    run_defaults = {**{k: v for k, (_, v) in fields_of(RunConfig).items() if k != "output_dir"},
                    "runner": DEFAULT_RUNNER}
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


def validate(cfg: DictConfig, errors: list[str], world_size: int = 1) -> dict:
    """Append every problem of a merged config to ``errors`` (unknown names are reported by `_merge_defaults`);
    return the neutral run keys resolved with their twins (``run_config.NEUTRAL_KEYS``)."""
    plain = OmegaConf.to_container(cfg, resolve=True)

    model = plain["model"]
    cls = model_class(model.get("arch"))
    if cls is not None:
        check_section(model, fields_of(cls), "model", errors, extra_keys=COMMON_MODEL_KEYS)
        for key, target in getattr(cls, "NESTED_SCHEMAS", {}).items():
            if isinstance(model.get(key), dict):  # overrides of a preset: nothing in them is required
                check_section(model[key], fields_of(target), f"model.{key}", errors, require=False)
        if hasattr(cls, "config_problems"):
            errors.extend(cls.config_problems(model))
    else:  # nothing close: only the keys every model takes can be checked
        check_section({k: v for k, v in model.items() if k in COMMON_MODEL_KEYS}, {}, "model", errors,
                      extra_keys=COMMON_MODEL_KEYS)

    if not plain["datasets"]:
        errors.append("datasets: no dataset configured")
    for name, section in plain["datasets"].items():
        _check_dataset(name, section, errors)

    run = plain["run"]
    options_sections = {cls.OPTIONS_KEY for cls in _runners().values() if cls.OPTIONS_KEY} | option_section_keys()
    check_section(run, fields_of(RunConfig), "run", errors, extra_keys=options_sections)
    runner_class = reg.runners.get(run["runner"]) if run.get("runner") in reg.runners else None
    errors.extend(objective_problems(run, runner_class))  # run.task and the options section named after it
    if isinstance(run.get("adam_betas"), list) and not valid_betas(run["adam_betas"]):  # a non-list: a type error
        errors.append(f"run.adam_betas: expected two numbers in [0, 1) (beta1, beta2), got {run['adam_betas']!r}")
    training = {name: section for name, section in plain["datasets"].items()
                if isinstance(section, dict) and _trains(section, run.get("train_splits") or [])}
    errors.extend(ratio_problems({name: section.get("sample_ratio") for name, section in training.items()}))
    errors.extend(data_problems(run, {name: builder_class(section.get("builder", name))
                                      for name, section in training.items()}))
    errors.extend(_image_size_problems(training))
    errors.extend(_model_image_size_problems(plain["datasets"], model, cls))
    for key, registry in (("runner", reg.runners), ("lr_sched", reg.lr_schedulers)):
        if isinstance(run.get(key), str) and run[key] not in registry:
            errors.append(f"run.{key}: {_lookup_error(registry, run[key])}")
    neutral = _neutral_settings(run, errors, world_size)
    runner = run.get("runner")
    close = runner if runner in reg.runners else reg.runners.closest(str(runner))
    if close is not None:  # the engine (or the closest to an unknown name) checks its own options section
        errors.extend(reg.runners.get(close).config_problems({**run, **(neutral or {})}, world_size,
                                                             neutral is not None))
    errors.extend(_split_problems(run, plain["datasets"]))
    errors.extend(metric_problems(run, plain["datasets"]))
    if cls is not None and close is not None:
        errors.extend(contract_problems(cls, model.get("arch"), run, reg.runners.get(close)))
    errors.extend(packing_problems(run, model, cls))
    errors.extend(hook_problems(run.get("hooks")))
    resume = run.get("resume")
    if not (resume in ("auto", False, None) or (isinstance(resume, str) and resume)):
        errors.append(f"run.resume: expected 'auto', false or a checkpoint path, got {resume!r}")
    elif isinstance(resume, str) and resume != "auto" and not Path(resume).is_dir():
        errors.append(f"run.resume: checkpoint folder {resume!r} does not exist")
    return neutral or {}


def _split_problems(run: dict, datasets: dict) -> list[str]:
    """Splits that no dataset has, and a training run with no split to train on."""
    # Split names are known only for datasets that list annotation files (generated ones have their own).
    annotations = [(section.get("build_info") or {}).get("annotations") for section in datasets.values()
                   if isinstance(section, dict)]
    splits = {s for a in annotations if a for s in a} if all(annotations) else set()
    problems = [f"run.{key}: split {split!r} is not in any dataset; available: {', '.join(sorted(splits))}"
                for key in ("train_splits", "valid_splits", "test_splits") for split in run.get(key) or []
                if splits and split not in splits]
    if run.get("train_splits") == [] and not run.get("evaluate"):  # the loop would have no data to draw from
        available = f" (available: {', '.join(sorted(splits))})" if splits else ""
        problems.append(f"run.train_splits: empty, so nothing trains; name the split(s) to train on{available}, or set "
                        "run.evaluate: true to evaluate a checkpoint without training")
    return problems


def _neutral_settings(run: dict, errors: list[str], world_size: int) -> dict | None:
    """Batch layout, clipping, precision and AdamW's betas/eps from the run keys and their twins in the runners'
    sections, once their values passed the type and range checks (a micro-batch of 0 is reported once, as
    run.batch_size_train's); None if they cannot be resolved."""
    twins, problems = option_twins(run)
    errors.extend(problems)
    written = tuple(f"run.{key}" for key in NEUTRAL_KEYS) + tuple(twin.path for twin in twins)
    if problems or any(e.startswith(written) for e in errors):
        return None
    try:
        resolved, spelled = resolve_twins(run, twins)
        tokens = token_budget_problems(resolved, spelled, errors)  # global_batch_tokens may fix the layout
        settings = training_settings({**resolved, **tokens}, world_size, spelled)
    except ValueError as e:
        errors.append(str(e))
        return None
    if tokens and isinstance(resolved.get("max_seq_len"), int):  # else an error names it: the tokens of a step
        tokens = {**tokens, "global_batch_tokens": settings.global_batch * resolved["max_seq_len"]}
    return {**{key: resolved[key] for key in NEUTRAL_KEYS}, "batch_size_train": settings.micro_batch,
            "accum_grad_iters": settings.accum, "global_batch_size": settings.global_batch,
            "precision": settings.precision, **tokens}  # grad_norm_clip stays unset if it was: no clipping either way


def _check_dataset(name: str, section: dict, errors: list[str]) -> None:
    path = f"datasets.{name}"
    if not isinstance(section, dict):
        errors.append(f"{path}: expected a mapping, got {section!r}")
        return
    # Unknown builder (reported by _merge_defaults): the section is checked against the closest one.
    cls = builder_class(section.get("builder", name))
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


def _model_image_size_problems(datasets: dict, model: dict, cls: type | None) -> list[str]:
    """Every image processor must make the size the vision tower is built for (its position embedding): the size
    the model class reads from its section (``image_size_of``)."""
    expected = cls.image_size_of(model) if cls is not None else None
    if not isinstance(expected, int):
        return []
    problems = []
    for name, section in datasets.items():
        processors = (section.get("vis_processor") or {}) if isinstance(section, dict) else {}
        for stage, proc in processors.items():
            if stage not in ("train", "eval"):
                continue  # reported as an unknown key
            known = isinstance(proc, dict) and proc.get("name") in reg.processors
            fields = fields_of(reg.processors.get(proc["name"])) if known else {}
            size = proc.get("image_size", fields["image_size"][1]) if "image_size" in fields else expected
            if size != expected:
                problems.append(f"datasets.{name}.vis_processor.{stage}.image_size: {size} but model.image_size is "
                                f"{expected}; the vision tower takes images of model.image_size only")
    return problems


def _missing_model_files(model: DictConfig, cls: type | None) -> list[str]:
    """Local files and folders the model reads (weights, tokenizer) must exist before any rank starts loading: the
    ones the model class names (``files_of``)."""
    files = cls.files_of(OmegaConf.to_container(model, resolve=True)) if cls is not None else {}
    return [f"model.{key}: {path!r} does not exist" for key, path in files.items()
            if not Path(os.path.expanduser(path)).exists()]


def contract_problems(cls: type, arch: str, run: dict, runner: type) -> list[str]:
    """What the model class lacks of the model contract (``models.base.CONTRACT``) for this run: training, the
    generation its test splits and validation metrics need, and what the runner calls (``MODEL_NEEDS``)."""
    from lavis_ds.common.registry import objectives as objective_registry
    from lavis_ds.models.base import missing

    uses = {"train": "run.train_splits" if not run.get("evaluate") and run.get("train_splits") else None,
            "generate": ("run.test_splits" if run.get("test_splits") else
                         "run.val_metrics" if run.get("val_metrics") else None)}
    uses["pack"] = "run.packing" if run.get("packing") else None
    uses["count"] = "run.batch_unit: tokens" if batch_unit(run) == "tokens" else None
    task = run.get("task")
    pairwise = isinstance(task, str) and task in objective_registry and objective_registry.get(task).DATA == "pairs"
    uses["pairs"] = f"run.task: {task}" if pairwise else None
    uses.update({need: f"run.runner: {run.get('runner') or runner.__name__}" for need in runner.MODEL_NEEDS})
    return [f"model.arch: {arch} ({cls.__name__}) has no {need.call}, which {why} needs (docs/extending.md, "
            f"\"The model contract\")" for use, why in uses.items() if why for need in missing(cls, [use])]


def token_budget_problems(run: dict, spelled: dict[str, str], errors: list[str]) -> dict:
    """``run.batch_unit: tokens``: its problems added to ``errors``; returns the run keys it resolves (the unit, and
    the global batch in rows if ``run.global_batch_tokens`` gave it), or {} for a run counted in samples.
    ``spelled``: where a batch key was written."""
    if batch_unit(run) != "tokens":
        if run.get("global_batch_tokens") is not None:
            errors.append("run.global_batch_tokens: only with run.batch_unit: tokens (or run.packing: true); this run "
                          "counts its batches in samples (run.global_batch_size)")
        return {}
    rows, given = run.get("max_seq_len"), run.get("global_batch_tokens")
    if run.get("length_grouped"):
        errors.append("run.length_grouped: sorts micro-batches of a fixed number of samples, but this run fills them "
                      "by tokens (run.batch_unit: tokens, the default with run.packing); drop one of the two")
    if not isinstance(rows, int):
        errors.extend([] if run.get("packing") else  # packing_problems names it
                      ["run.batch_unit: tokens: set run.max_seq_len, the tokens of a row of a micro-batch"])
        return {"batch_unit": "tokens"}
    if given is None or not isinstance(given, int):
        return {"batch_unit": "tokens"}
    if given % rows:
        errors.append(f"run.global_batch_tokens={given} is not a multiple of run.max_seq_len={rows}: an optimizer step "
                      f"is a whole number of rows; e.g. {given // rows * rows or rows}")
        return {"batch_unit": "tokens"}
    if run.get("global_batch_size") not in (None, given // rows):
        where = spelled.get("global_batch_size", "run.global_batch_size")
        errors.append(f"run.global_batch_tokens={given} is {given // rows} rows of run.max_seq_len={rows}, but "
                      f"{where}={run['global_batch_size']}; give one of the two")
        return {"batch_unit": "tokens"}
    return {"batch_unit": "tokens", "global_batch_size": given // rows}


def packing_problems(run: dict, model: dict, cls: type | None = None) -> list[str]:
    """run.packing and a token budget need a row length that holds the longest sample the model makes
    (its class's ``text_length_of``: model.max_txt_len)."""
    if not run.get("packing") and batch_unit(run) != "tokens":
        return []
    rows, longest = run.get("max_seq_len"), (cls.text_length_of(model) if cls is not None else None)
    if rows is None and run.get("packing"):
        return ["run.packing: set run.max_seq_len, the tokens of a packed row (at least model.max_txt_len"
                + (f", {longest})" if isinstance(longest, int) else ")")]
    if isinstance(rows, int) and isinstance(longest, int) and rows < longest:
        return [f"run.max_seq_len={rows} is shorter than model.max_txt_len={longest}: a sample could not fit in a "
                f"row; raise run.max_seq_len to at least {longest} or lower model.max_txt_len"]
    return []
