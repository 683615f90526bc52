"""The built-in evaluation hooks: validation during training, test generation at the end."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from lavis_ds.common import comm
from lavis_ds.common.errors import OutputError
from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.metrics import build_metric
from lavis_ds.metrics.selection import TEST, VALID, log_key, metric_names
from lavis_ds.runners.evaluation import evaluate_loss, generate_split
from lavis_ds.runners.hooks.base import Hook


def score_split(trainer, split: str, phase: str, metrics: list[str]) -> tuple[dict, list[dict]]:
    """Generate a split, score it with its metrics (rank 0), write its predictions file; (scores, results).
    ``metrics``: the run's for ``phase`` (run.val_metrics or run.test_metrics), where a section names none.

    Every rank generates its shard (ZeRO-3 forwards are collective); the metrics and the file are
    made once, on rank 0, from the gathered results.
    """
    results = generate_split(trainer, split)
    scores: dict = {"num_samples": len(results)}
    if trainer.rank != 0:
        return scores, results
    sections = list(dict.fromkeys(r["dataset"] for r in results))
    run = _run_metrics(phase, metrics)
    for section in sections:
        rows = [r for r in results if r["dataset"] == section]
        names = metric_names(run, OmegaConf.to_container(trainer.cfg.datasets[section], resolve=True), phase)
        for name in names:
            values = build_metric(name)([r["generated"] for r in rows], [r["references"] for r in rows])
            for score, value in values.items():
                scores[log_key(name, score, section if len(sections) > 1 else None)] = value
    try:
        write_predictions(trainer.output_dir / "predictions" / f"{split}_step{trainer.state.global_step}.jsonl",
                          results)
    except OutputError as e:  # rank 0 only: every rank stops at the next agreement (HookList.defer)
        trainer.hooks.defer(e)
    return scores, results


def _run_metrics(phase: str, metrics: list[str]) -> dict:
    """The run's metrics of ``phase`` under the key ``metric_names`` reads them from."""
    return {"test_metrics" if phase == TEST else "val_metrics": list(metrics)}


def write_predictions(path: Path, results: list[dict]) -> None:
    """One JSON line per sample: image, prompt, references, generated (and index, dataset); atomic."""
    keys = ("index", "dataset", "image", "prompt", "references", "generated")
    write_json_lines(path, [{k: r[k] for k in keys} for r in results])


def write_json_lines(path: Path, rows: list[dict]) -> None:
    """One JSON line per row, atomically: a rerun after a kill replaces the file, a reader never sees half of it."""
    tmp = path.with_suffix(".jsonl.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # a part-written file is never read; gone if the disk lets it go
            tmp.unlink(missing_ok=True)
        raise OutputError.writing("the predictions", path, e) from None


@hook_registry.register("validation")
class Validation(Hook):
    """Validation loss on each of `run.valid_splits` - plus generation metrics where the split has some
    (`run.val_metrics` or the section's `metrics`) - at every epoch end and every `run.val_freq_steps` steps.

    Each split's results are one record (``{"split": "val", "loss": ..., "caption/CIDEr": ...}``), logged
    through ``trainer.hooks.log``: metrics.jsonl, the trackers and the best-checkpoint scoring read them there.
    """

    def __init__(self, valid_splits: tuple[str, ...] = (), val_freq_steps: int = 0,
                 val_metrics: tuple[str, ...] = ()) -> None:
        """run.valid_splits, run.val_freq_steps (0: at epoch ends only), run.val_metrics."""
        self.valid_splits, self.val_freq_steps, self.val_metrics = tuple(valid_splits), val_freq_steps, list(val_metrics)

    def after_step(self, trainer, metrics: dict) -> None:
        freq = self.val_freq_steps
        at_epoch_end = trainer.state.step_in_epoch == trainer.data.steps_per_epoch  # after_epoch validates that one
        if freq and trainer.state.global_step % freq == 0 and not at_epoch_end:
            self.validate(trainer)

    def after_epoch(self, trainer) -> None:
        self.validate(trainer)

    def evaluate(self, trainer) -> None:
        self.validate(trainer)

    def validate(self, trainer) -> None:
        if not self.valid_splits:
            return
        run = _run_metrics(VALID, self.val_metrics)
        datasets = OmegaConf.to_container(trainer.cfg.datasets, resolve=True)
        for split in self.valid_splits:
            record = {"split": split, **evaluate_loss(trainer, split)}
            if any(metric_names(run, datasets[name], VALID) for name, per_split in trainer.data.datasets.items()
                   if split in per_split):
                record.update(score_split(trainer, split, VALID, self.val_metrics)[0])
            trainer.hooks.log({"step": trainer.state.global_step, "epoch": trainer.state.epoch, **record})


@hook_registry.register("test_generation")
class TestGeneration(Hook):
    """Generate answers for `run.test_splits`; log their metrics (`run.test_metrics` or the section's `metrics`)
    with a few samples, and write the predictions file."""

    def __init__(self, test_splits: tuple[str, ...] = (), test_metrics: tuple[str, ...] = ("exact_match",),
                 num_log_samples: int = 5) -> None:
        """run.test_splits, run.test_metrics, run.num_log_samples (generated samples logged per split)."""
        self.test_splits, self.test_metrics, self.num_log_samples = tuple(test_splits), list(test_metrics), num_log_samples

    def after_train(self, trainer) -> None:
        self.test(trainer)

    def evaluate(self, trainer) -> None:
        self.test(trainer)

    def test(self, trainer) -> None:
        for split in self.test_splits:
            scores, results = score_split(trainer, split, TEST, self.test_metrics)
            samples = results[: self.num_log_samples]
            trainer.hooks.log({"step": trainer.state.global_step, "epoch": trainer.state.epoch, "split": split,
                              **scores, "samples": samples})
        comm.barrier()
