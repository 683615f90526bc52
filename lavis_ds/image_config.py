"""The image side of a run config: which image processors the datasets get, what the tower fills into them, and
whether the images they make are the ones the vision tower takes.

A model's settings say how its tower's images are prepared (``image_processing()``: size, mean/std, resize,
padding) and which processors a dataset that names none gets (``IMAGE_PROCESSORS``: ``tower_image_train`` and
``tower_image_eval`` for ``llava`` and ``instructblip``; ``blip2_qwen`` keeps its builders' LAVIS defaults). The
keys a ``tower_image_*`` section leaves out are filled from the tower when the config is loaded, so the run's
config.yaml, its checkpoints and its exports all hold the processing the run used.

A processor whose images differ from what the tower was trained on is a config problem when nobody asked for the
difference (``blip2_image_*``'s default CLIP mean/std before a SigLIP tower, a tower padding to a square before a
processor that does not pad): the model would train on pixels its tower never saw, and its export would serve the
same pixels, so nothing later would show it. A difference the YAML writes out (``mean:``/``std:`` given, a
``tower_image_*`` key set against the tower) is a decision, and is logged as a warning.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from lavis_ds.common import dist
from lavis_ds.common import registry as reg
from lavis_ds.common.schema import fields_of
from lavis_ds.datasets.processor_sections import build_processor
from lavis_ds.models.settings.base import model_settings, settings_class
from lavis_ds.processors.image import ImageProcessing, awaits_tower

logger = logging.getLogger(__name__)

STAGES = ("train", "eval")


def with_model_processors(defaults: DictConfig, model_cls: type | None) -> DictConfig:
    """A builder's default section with the model's own image processors (``IMAGE_PROCESSORS``) in place of the
    builder's: a dataset section that names no processor then gets the model's; one that names another replaces
    it (``processor_sections.merge_section_defaults``)."""
    processors = settings_class(model_cls).IMAGE_PROCESSORS if model_cls is not None else {}
    if not processors:
        return defaults
    defaults = defaults.copy()
    defaults.vis_processor = OmegaConf.create({stage: {"name": name} for stage, name in processors.items()})
    return defaults


def fill_tower_processing(cfg: DictConfig, model_cls: type | None) -> None:
    """Fill the keys each ``tower_image_*`` section of ``cfg.datasets`` leaves out from the model's tower (in place).

    Nothing is filled where the model cannot say (a broken ``model:`` section is reported by its own check, a
    missing tower folder by the file check; ``image_problems`` names what is left unfilled otherwise)."""
    sections = [proc for _, _, proc in _image_processors(cfg.datasets) if _from_tower(proc)]
    if not sections or model_cls is None:
        return
    processing = model_settings(model_cls, OmegaConf.to_container(cfg.model, resolve=True)).image_processing()
    if processing is None:
        return
    for proc in sections:
        if not _takes(proc, processing):
            continue  # a processor for another kind of tower: image_problems names it
        for key, value in processing.processor_keys().items():
            if proc.get(key) is None:
                proc[key] = value


def model_eval_processor(model_cls: type | None, processing: ImageProcessing | None, image_size: int) -> dict:
    """The eval image processor section of a model whose run names none (generation and export from a config
    without datasets): the model's own (its tower's processing, filled in) if it names one, else
    ``blip2_image_eval`` at ``image_size``."""
    name = (settings_class(model_cls).IMAGE_PROCESSORS if model_cls is not None else {}).get("eval")
    if name and processing is not None:
        section = {"name": name}
        if _from_tower(section):
            section.update(processing.processor_keys())
        return section
    return {"name": "blip2_image_eval", "image_size": int(image_size)}


def image_problems(datasets: dict, training: dict[str, dict], model: dict, model_cls: type | None,
                   model_errors: list[str]) -> list[str]:
    """Every image problem of a merged, filled config: sizes that differ between training datasets or from the
    tower's, ``tower_image_*`` keys nothing filled, and processing that differs from the tower's (refused, or
    logged when written out: see the module docstring). ``model_errors``: the problems found in the ``model:``
    section (with an unknown arch or preset the model is not asked; with any, nothing filled is no news)."""
    problems = _training_size_problems(training)
    if model_cls is None or any(e.startswith(("model.arch", "model.model_type")) for e in model_errors):
        return problems  # no preset gave the tower
    problems += _model_size_problems(datasets, model, model_cls)
    # A tower folder not there (reported by the file check, or on another machine) is what would have said.
    settings = model_settings(model_cls, model)
    if not model_errors and all(Path(p).expanduser().exists() for p in settings.files().values()):
        problems += _unfilled_problems(datasets, model)
    processing = settings.image_processing()
    if processing is not None:
        problems += _kind_problems(datasets, model, processing)
        problems += _mismatch_problems(datasets, model, processing)
    return problems


# ----------------------------------------------------------------------------- sizes
def _training_size_problems(training: dict[str, dict]) -> list[str]:
    """Training batches stack the images of every training dataset: they must have one size."""
    sizes = {}
    for name, section in training.items():
        proc = (section.get("vis_processor") or {}).get("train")
        size = _size_of(proc)
        if size is not None:  # a processor without the argument says nothing about the size
            sizes[name] = size
    first = next(iter(sizes), None)
    return [f"datasets.{name}.vis_processor.train.image_size: {size} differs from datasets.{first}'s "
            f"{sizes[first]}; datasets that train together must make images of one size (a batch mixes them)"
            for name, size in sizes.items() if size != sizes[first]]


def _model_size_problems(datasets: dict, model: dict, model_cls: type) -> list[str]:
    """Every image processor must make the size the vision tower is built for (its position embedding): the size
    the model's settings read from its section (``image_size()``)."""
    expected = model_settings(model_cls, model).image_size()
    if not isinstance(expected, int):
        return []
    problems = []
    for name, stage, proc in _image_processors(datasets):
        size = _size_of(proc)
        if size is None or size == expected:
            continue
        where = f"datasets.{name}.vis_processor.{stage}.image_size"
        if "image_size" in model:
            problems.append(f"{where}: {size} but model.image_size is {expected}; the vision tower takes images of "
                            "model.image_size only")
        else:  # the tower's own section (or its published folder) fixes the size
            problems.append(f"{where}: {size} but the model's vision tower takes {expected} px images only; set "
                            f"this image_size to {expected}")
    return problems


def _size_of(proc: Any) -> int | None:
    known = isinstance(proc, Mapping) and proc.get("name") in reg.processors
    fields = fields_of(reg.processors.get(proc["name"])) if known else {}
    if "image_size" not in fields:
        return None
    size = proc.get("image_size", fields["image_size"][1])
    return size if isinstance(size, int) else None  # unfilled (None) or mistyped: reported elsewhere


# ----------------------------------------------------------------------------- the tower's processing
def _unfilled_problems(datasets: dict, model: dict) -> list[str]:
    problems = []
    for name, stage, proc in _image_processors(datasets):
        if awaits_tower(proc):
            missing = [key for key in reg.processors.get(proc["name"]).TOWER_KEYS if proc.get(key) is None]
            problems.append(f"datasets.{name}.vis_processor.{stage}: {proc['name']} takes {', '.join(missing)} from "
                            f"the model's vision tower, and model.arch {model.get('arch')} describes none; give them "
                            f"here, or name another processor (blip2_image_{stage})")
    return problems


def _takes(proc: Mapping[str, Any], processing: Any) -> bool:
    """Whether the ``FROM_TOWER`` processor ``proc`` names takes every key of the tower's ``processing``: a
    ``tower_image_*`` processor a fixed-size tower's, ``qwen_vl_image`` a Qwen-VL tower's."""
    keys = getattr(reg.processors.get(proc["name"]), "TOWER_KEYS", ())
    return set(processing.processor_keys()) <= set(keys)


def _kind_problems(datasets: dict, model: dict, processing: Any) -> list[str]:
    """A processor that takes its keys from the tower, but from another kind of tower than the model's."""
    problems = []
    for name, stage, proc in _image_processors(datasets):
        if _from_tower(proc) and not _takes(proc, processing):
            fitting = [n for n in reg.processors if _from_tower({"name": n}) and _takes({"name": n}, processing)]
            fitting = [n for n in fitting if n.endswith(stage)] or fitting
            problems.append(f"datasets.{name}.vis_processor.{stage}: {proc['name']} prepares images for another kind "
                            f"of vision tower than the model's {_tower_label(model)}; use {' or '.join(fitting)}")
    return problems


def _mismatch_problems(datasets: dict, model: dict, tower: ImageProcessing) -> list[str]:
    """Processing that differs from the tower's: a problem where the processor's defaults differ, a warning where
    the section writes the difference out."""
    label = _tower_label(model)
    problems, warnings = [], []
    for name, stage, proc in _image_processors(datasets):
        ours = section_processing(proc)
        if ours is None:
            continue
        where, processor = f"datasets.{name}.vis_processor.{stage}", proc["name"]
        instead = f"use {{name: tower_image_{stage}}} (the tower's own processing, which its export serves too)"
        if not (_close(ours.mean, tower.mean) and _close(ours.std, tower.std)):
            if proc.get("mean") is None and proc.get("std") is None:
                problems.append(
                    f"{where}: {processor} normalises with mean {_fmt(ours.mean)} and std {_fmt(ours.std)} (its "
                    f"default), but the model's {label} was trained with mean {_fmt(tower.mean)} and std "
                    f"{_fmt(tower.std)}: the model would train on pixels its tower never saw. {instead.capitalize()}, "
                    f"or set mean: {_fmt(tower.mean)} and std: {_fmt(tower.std)} here")
            else:
                warnings.append(f"{where}: mean {_fmt(ours.mean)} and std {_fmt(ours.std)} as given, not those the "
                                f"model's {label} was trained with (mean {_fmt(tower.mean)}, std {_fmt(tower.std)})")
        if tower.pad_to_square and not ours.pad_to_square:
            if "pad_to_square" in proc:
                warnings.append(f"{where}: pad_to_square: false as given, though the model's {label} pads images to "
                                "a square with the mean colour")
            else:
                problems.append(
                    f"{where}: {processor} does not pad, but model.vision_tower.pad_to_square is true: the padding "
                    "to a square with the mean colour would reach neither training nor the export. "
                    f"{instead.capitalize()}, or set model.vision_tower.pad_to_square: false")
        elif ours.pad_to_square and not tower.pad_to_square:
            warnings.append(f"{where}: pad_to_square: true as given, though the model's {label} does not pad")
    if warnings and dist.is_main_process():  # every rank loads the config; one says it
        for line in warnings:
            logger.warning("%s", line)
    return problems


def section_processing(proc: Mapping[str, Any], served: bool = False) -> ImageProcessing | None:
    """The processing an image processor section's images have (the built processor's ``processing``); None: it
    does not say, or its section does not build (reported by the dataset check), or - ``served``: as an export's
    image processor must reproduce it - it augments (random crops, flips), which no served processor does."""
    try:
        processor = build_processor(proc)
    except (KeyError, ValueError, TypeError):
        return None
    processing = getattr(processor, "processing", None)
    if not isinstance(processing, ImageProcessing) or (served and getattr(processor, "augments", False)):
        return None
    return processing


def _image_processors(datasets: Mapping) -> list[tuple[str, str, Any]]:
    """``(dataset name, stage, section)`` of every image processor section that names a registered processor."""
    found = []
    for name, section in datasets.items():
        processors = section.get("vis_processor") if isinstance(section, Mapping) else None
        if not isinstance(processors, Mapping):
            continue
        for stage, proc in processors.items():
            if stage in STAGES and isinstance(proc, Mapping) and proc.get("name") in reg.processors:
                found.append((str(name), str(stage), proc))
    return found


def _from_tower(proc: Any) -> bool:
    return bool(getattr(reg.processors.get(proc["name"]), "FROM_TOWER", False))


def _tower_label(model: dict) -> str:
    tower = model.get("vision_tower")
    name = tower.get("name") if isinstance(tower, Mapping) else None
    return f"vision tower ({name})" if name else "vision tower"


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a, b))


def _fmt(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:.8g}" for v in values) + "]"


def eval_processors_of(cfg: DictConfig) -> tuple[Any, Any | None]:
    """``(image processor, text processor or None)`` a run config (or an export's config.yaml) evaluates with: its
    first dataset section's eval processors; without one, the model's own (its tower's processing for llava and
    instructblip, else ``blip2_image_eval`` at the model's ``image_size``)."""
    for section in (cfg.get("datasets") or {}).values():
        if "vis_processor" in section:
            text = section.get("text_processor")
            return build_processor(section.vis_processor.eval), build_processor(text.eval) if text else None
    import lavis_ds.models  # noqa: F401  (registers the models)

    model_cls = reg.models.get(cfg.model.arch)  # the model says what its tower takes
    section = OmegaConf.to_container(cfg.model, resolve=True)
    settings = model_settings(model_cls, section)
    processing, size = settings.image_processing(), settings.image_size()
    return build_processor(model_eval_processor(model_cls, processing, size)), None
