"""The processor keys of a ``datasets.<name>`` section: ``vis_processor`` and ``text_processor``, each
``{train: {name: ..., <arguments>}, eval: {...}}``.

Here a processor is built from its section, a builder's default processors are merged under the user's, the
keys are checked, and a split is matched to the stage whose processors it uses: the "train" split the
``train`` ones, every other split the ``eval`` ones.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf

import lavis_ds.processors  # noqa: F401  (registers the processors the sections name)
from lavis_ds.common import registry as reg
from lavis_ds.processors.base import BaseProcessor
from lavis_ds.processors.image import awaits_tower

PROCESSOR_KINDS = ("vis_processor", "text_processor")
PROCESSOR_STAGES = ("train", "eval")


def build_processor(cfg: Mapping[str, Any]) -> BaseProcessor:
    """Look up ``cfg["name"]`` in the processor registry and build it from the rest of ``cfg``."""
    if not isinstance(cfg, Mapping) or "name" not in cfg:
        raise ValueError(f"a processor section needs a `name` (one of: {', '.join(reg.processors)}), got {cfg!r}")
    return reg.processors.get(cfg["name"]).from_config(cfg)


def merge_section_defaults(defaults: DictConfig, section: DictConfig) -> DictConfig:
    """``section`` over ``defaults``, minus default processors that ``section`` replaces by another ``name``.

    The replaced processor's arguments (e.g. ``min_scale``) would not fit the new one.
    """
    defaults = defaults.copy()
    for kind in PROCESSOR_KINDS:
        for stage, proc in (section.get(kind) or {}).items():
            default = (defaults.get(kind) or {}).get(stage)
            if default is not None and isinstance(proc, DictConfig) and proc.get("name", default.name) != default.name:
                del defaults[kind][stage]
    return OmegaConf.merge(defaults, section)


def processor_stage(split: str) -> str:
    """The stage whose processors ``split`` uses: ``train`` for the "train" split, ``eval`` for every other."""
    return "train" if split == "train" else "eval"


def processor_problems(section: Mapping[str, Any], where: str, splits: Iterable[str]) -> list[str]:
    """Every problem of ``section``'s processor keys (``where``: its key path, for messages): an unknown stage, a
    processor that cannot be built, and a missing ``vis_processor`` for a stage one of ``splits`` uses."""
    problems = []
    for kind in PROCESSOR_KINDS:
        processors = section.get(kind) or {}
        if not isinstance(processors, dict):
            problems.append(f"{where}.{kind}: expected {{train: {{name: ...}}, eval: {{name: ...}}}}")
            continue
        for stage, proc_cfg in processors.items():
            if stage not in PROCESSOR_STAGES:
                problems.append(f"{where}.{kind}.{stage}: unknown key; valid keys: train, eval")
                continue
            if awaits_tower(proc_cfg):
                continue  # the config loader fills it from the model's tower, or says why it cannot
            try:
                build_processor(proc_cfg)
            except (KeyError, ValueError, TypeError) as e:
                problems.append(f"{where}.{kind}.{stage}: {e.args[0] if e.args else e}")
    vis = section.get("vis_processor") if isinstance(section.get("vis_processor"), dict) else {}
    for stage in sorted({processor_stage(split) for split in splits}):
        if stage not in vis:
            problems.append(f"{where}.vis_processor.{stage}: required for the "
                            f"{'train split' if stage == 'train' else 'evaluation splits'}, "
                            f"e.g. {{name: blip2_image_{stage}, image_size: 224}}")
    return problems
