"""Which metrics score which split, the names they are logged under, and their config checks.

A split's metrics: the dataset section's ``metrics`` if set, else ``run.test_metrics``
(test splits) or ``run.val_metrics`` (valid splits). A score is logged as
``<metric>`` when the metric has one score named like itself (``exact_match``),
else ``<metric>/<score>`` (``caption/CIDEr``); when several datasets share a split,
each is scored on its own samples and its keys start with the section name
(``coco/caption/CIDEr``). ``run.best_metric`` is ``<split>/<logged key>``, or
``<split>/loss``, or a benchmark score of `run.lmms_eval` (``lmms_eval/<task>/<metric>``).
"""
from __future__ import annotations

from typing import Any, Mapping

from lavis_ds.common import registry as reg

TEST, VALID = "test", "valid"
LMMS_EVAL_SPLIT = "lmms_eval"  # the split of the lmms-eval hook's records: run.best_metric lmms_eval/<task>/<metric>


def metric_names(run: Mapping[str, Any], section: Mapping[str, Any], phase: str) -> list[str]:
    """The metrics of one dataset section's split in ``phase`` (TEST or VALID)."""
    names = section.get("metrics") if isinstance(section, Mapping) else None
    if names is None:
        names = run.get("test_metrics" if phase == TEST else "val_metrics") or []
    return list(names)


def log_key(metric: str, score: str, dataset: str | None = None) -> str:
    key = metric if score == metric else f"{metric}/{score}"
    return f"{dataset}/{key}" if dataset else key


def split_keys(run: Mapping[str, Any], datasets: Mapping[str, Mapping], split: str, phase: str) -> list[str]:
    """Every key a split's evaluation record holds (besides loss and counts), for messages and checks."""
    sections = {name: s for name, s in datasets.items() if _has_split(s, split)}
    several = len(sections) > 1
    keys = []
    for name, section in sections.items():
        for metric in metric_names(run, section, phase):
            if metric in reg.metrics:
                for score in reg.metrics.get(metric).scores:
                    keys.append(log_key(metric, score, name if several else None))
    return keys


def higher_is_better(best_metric: str) -> bool:
    """Direction of ``run.best_metric``: the loss is lower-is-better, a metric says for itself."""
    parts = best_metric.split("/")[1:]
    for part in parts:
        if part in reg.metrics:
            return reg.metrics.get(part).higher_is_better
    return False  # loss


def metric_problems(run: Mapping[str, Any], datasets: Mapping[str, Any]) -> list[str]:
    """Unknown metric names (with the known ones), a bad val_freq_steps, a best_metric nothing logs."""
    problems = []
    named = [(f"run.{key}", run.get(key)) for key in ("test_metrics", "val_metrics")]
    named += [(f"datasets.{name}.metrics", s.get("metrics")) for name, s in datasets.items() if isinstance(s, Mapping)]
    for where, names in named:
        for i, name in enumerate(names or []):
            if name not in reg.metrics:
                try:
                    reg.metrics.get(name)
                except KeyError as e:
                    problems.append(f"{where}[{i}]: {e.args[0]}")
    freq = run.get("val_freq_steps")
    if isinstance(freq, int) and freq < 0:
        problems.append(f"run.val_freq_steps: expected 0 (epoch ends only) or a positive step count, got {freq}")
    best = run.get("best_metric")
    # lmms_eval/<task>/<metric>: a benchmark score, checked against its tasks (runners.hooks.lmms_eval_checks)
    if isinstance(best, str) and not problems and not best.startswith(f"{LMMS_EVAL_SPLIT}/"):
        valid = run.get("valid_splits") or []
        choices = [f"{split}/{key}" for split in valid
                   for key in ["loss", *split_keys(run, datasets, split, VALID)]]
        if best not in choices:
            problems.append(f"run.best_metric: {best!r} is not logged by validation; choose one of: "
                            f"{', '.join(choices) or '(none: set run.valid_splits)'}")
    return problems


def _has_split(section: Mapping, split: str) -> bool:
    annotations = (section.get("build_info") or {}).get("annotations") if isinstance(section, Mapping) else None
    # Generated data (demo_shapes) lists no annotations: it has train/val/test.
    return split in annotations if isinstance(annotations, Mapping) else split in ("train", "val", "test")
