"""What happens around the loop: logging, evaluation, checkpoints.

Each hook reacts to before_train / after_step / after_epoch / after_save / after_train, to
on_stop (a SIGTERM/SIGINT stops the run at a step boundary), to evaluate (`run.evaluate`:
evaluate a checkpoint, no training) and to close (the run is over, however it ended: release
what the hook made). Their order in `build_hooks` is their run order.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

from lavis_ds.common import comm
from lavis_ds.common.logger import MetricsWriter
from lavis_ds.metrics import build_metric
from lavis_ds.metrics.selection import TEST, VALID, higher_is_better, log_key, metric_names
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.throughput import ThroughputMeter


class Hook:
    def before_train(self, runner) -> None: ...

    def after_step(self, runner, metrics: dict) -> None: ...

    def after_epoch(self, runner) -> None: ...

    def after_save(self, runner, tag_dir: Path) -> None: ...

    def after_train(self, runner) -> None: ...

    def on_stop(self, runner, signum: int) -> None: ...

    def evaluate(self, runner) -> None: ...

    def close(self, runner) -> None: ...


def build_hooks(runner) -> list[Hook]:
    logger = MetricsLogger()
    validation = Validation(logger)
    return [
        # Logging first: a step's numbers are on disk before a checkpoint can be cut at that step.
        logger,
        # Validation before the checkpoint of the same step, so that the checkpoint can be scored by it.
        validation,
        Checkpointer(),
        # Reacts to saves only: scores each checkpoint by run.best_metric and prunes to run.keep_last + the best.
        BestCheckpoint(validation),
        # Generation-based test metrics once, at the very end.
        TestGeneration(logger),
        # Last: training time restarts once a step's evaluations and saves are done, so they do not count in tokens/s.
        TrainingClock(logger.meter),
    ]


class MetricsLogger(Hook):
    """metrics.jsonl + TensorBoard on rank 0 every `run.log_freq` steps, and a progress bar with ETA.

    Each logged step carries its throughput since the last one (``runners.throughput``: tokens/s,
    padding share, peak memory, MFU). Owns the writer and the bar: other hooks write their records
    through ``log``.
    """

    def __init__(self) -> None:
        self.writer, self.bar = None, None
        self.meter = ThroughputMeter()

    def before_train(self, runner) -> None:
        if runner.rank == 0:
            resumed = runner.state.global_step if runner.state.global_step else None
            self.writer = MetricsWriter(runner.output_dir, resume_step=resumed)
            self.bar = tqdm(total=runner.total_steps, initial=runner.state.global_step, desc="train",
                            dynamic_ncols=True, mininterval=1.0)
        self.meter.start(runner)

    def after_step(self, runner, metrics: dict) -> None:
        metrics = dict(metrics)
        self.meter.step_done(metrics.pop("tokens", None))  # every rank: its own tokens
        if runner.rank == 0:
            self.bar.update(1)
        step = runner.state.global_step
        if step % runner.run.log_freq and step != runner.total_steps:
            return
        throughput = self.meter.report(runner)  # collective: every rank takes the same steps
        if runner.rank != 0:
            return
        record = {"step": step, "epoch": runner.state.epoch, **metrics, **throughput}
        self.writer.write(record)
        if record["loss"] is not None:  # None: a skipped step (non-finite loss)
            self.bar.set_postfix(_postfix(record))

    def log(self, runner, record: dict) -> None:
        """An evaluation record, at the current step: to metrics.jsonl and TensorBoard, and one line on screen."""
        if runner.rank != 0:
            return
        self.writer.write({"step": runner.state.global_step, "epoch": runner.state.epoch, **record})
        tqdm.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items() if k != "samples"))

    def after_train(self, runner) -> None:
        self._close_bar()  # the writer stays open for the final tests

    def on_stop(self, runner, signum: int) -> None:
        self._close_bar()

    def close(self, runner) -> None:
        self._close_bar()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _postfix(record: dict) -> dict[str, str]:
    """What the progress bar shows of a logged step."""
    shown = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}"}
    if "tokens_per_sec" in record:
        shown["tok/s"] = f"{record['tokens_per_sec']:,.0f}"
    if "mfu" in record:
        shown["mfu"] = f"{record['mfu']:.1%}"
    return shown


class TrainingClock(Hook):
    """Restarts the throughput clock when a step's hooks (evaluation, checkpoints) are done, and after an epoch's."""

    def __init__(self, meter: ThroughputMeter) -> None:
        self.meter = meter

    def after_step(self, runner, metrics: dict) -> None:
        self.meter.mark()

    def after_epoch(self, runner) -> None:
        self.meter.mark()


def score_split(runner, split: str, phase: str) -> tuple[dict, list[dict]]:
    """Generate a split, score it with its metrics (rank 0), write its predictions file; (scores, results).

    Every rank generates its shard (ZeRO-3 forwards are collective); the metrics and the file are
    made once, on rank 0, from the gathered results.
    """
    results = runner.generate_split(split)
    scores: dict = {"num_samples": len(results)}
    if runner.rank != 0:
        return scores, results
    sections = list(dict.fromkeys(r["dataset"] for r in results))
    run = OmegaConf.to_container(runner.run, resolve=True)
    for section in sections:
        rows = [r for r in results if r["dataset"] == section]
        names = metric_names(run, OmegaConf.to_container(runner.cfg.datasets[section], resolve=True), phase)
        for name in names:
            values = build_metric(name)([r["generated"] for r in rows], [r["references"] for r in rows])
            for score, value in values.items():
                scores[log_key(name, score, section if len(sections) > 1 else None)] = value
    write_predictions(runner.output_dir / "predictions" / f"{split}_step{runner.state.global_step}.jsonl", results)
    return scores, results


def write_predictions(path: Path, results: list[dict]) -> None:
    """One JSON line per sample: image, prompt, references, generated (and index, dataset); atomic."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ("index", "dataset", "image", "prompt", "references", "generated")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps({k: r[k] for k in keys}, ensure_ascii=False) + "\n" for r in results),
                   encoding="utf-8")
    os.replace(tmp, path)


class Validation(Hook):
    """Validation loss on each of `run.valid_splits` - plus generation metrics where the split has some
    (`run.val_metrics` or the section's `metrics`) - at every epoch end and every `run.val_freq_steps` steps.

    ``latest`` holds the newest results: ``{"step": N, "scores": {"val/loss": ..., "val/caption/CIDEr": ...}}``.
    """

    def __init__(self, logger: MetricsLogger) -> None:
        self.logger = logger
        self.latest: dict = {}

    def after_step(self, runner, metrics: dict) -> None:
        freq = runner.run.val_freq_steps
        at_epoch_end = runner.state.step_in_epoch == runner.steps_per_epoch  # after_epoch validates that one
        if freq and runner.state.global_step % freq == 0 and not at_epoch_end:
            self.validate(runner)

    def after_epoch(self, runner) -> None:
        self.validate(runner)

    def evaluate(self, runner) -> None:
        self.validate(runner)

    def validate(self, runner) -> None:
        if not runner.run.valid_splits:
            return
        run = OmegaConf.to_container(runner.run, resolve=True)
        datasets = OmegaConf.to_container(runner.cfg.datasets, resolve=True)
        scores = {}
        for split in runner.run.valid_splits:
            record = {"split": split, **runner.evaluate_loss(split)}
            if any(metric_names(run, datasets[name], VALID) for name, per_split in runner.datasets.items()
                   if split in per_split):
                record.update(score_split(runner, split, VALID)[0])
            self.logger.log(runner, record)
            scores.update({f"{split}/{k}": v for k, v in record.items() if isinstance(v, float)})
        self.latest = {"step": runner.state.global_step, "scores": scores}


class Checkpointer(Hook):
    """Every `run.save_freq_steps` optimizer steps, at each epoch end, and when SIGTERM stops the run."""

    def after_step(self, runner, metrics: dict) -> None:
        freq = runner.run.save_freq_steps
        at_epoch_end = runner.state.step_in_epoch == runner.steps_per_epoch  # after_epoch saves that one
        if freq and runner.state.global_step % freq == 0 and not at_epoch_end:
            runner.save()

    def after_epoch(self, runner) -> None:
        runner.save()

    def on_stop(self, runner, signum: int) -> None:
        # SIGTERM is preemption: save where every rank stopped, unless that step is saved already.
        # SIGINT is a user's Ctrl-C: stop without writing anything.
        if signum == signal.SIGTERM and runner.state.global_step not in (0, runner.saved_step):
            runner.save()


class BestCheckpoint(Hook):
    """Owns "the best checkpoint": scores each one by `run.best_metric` and prunes to `run.keep_last` + the best.

    A checkpoint cut right after a validation gets ``lavis_ds_score.json`` (metric, value, direction);
    the best is read back from those files, so it survives a resume. `run.best_metric` defaults to the
    first valid split's loss (lower is better); a metric says its own direction (CIDEr: higher).
    """

    SCORE_FILE = "lavis_ds_score.json"

    def __init__(self, validation: Validation) -> None:
        self.validation = validation

    def metric(self, runner) -> str | None:
        if runner.run.best_metric:
            return runner.run.best_metric
        return f"{runner.run.valid_splits[0]}/loss" if runner.run.valid_splits else None

    def after_save(self, runner, tag_dir: Path) -> None:
        if runner.rank != 0:
            return
        metric, latest = self.metric(runner), self.validation.latest
        if metric and latest.get("step") == runner.state.global_step and metric in latest["scores"]:
            info = {"metric": metric, "value": latest["scores"][metric], "higher_is_better": higher_is_better(metric)}
            (Path(tag_dir) / self.SCORE_FILE).write_text(json.dumps(info, indent=2))
        if runner.run.keep_last:
            ckpt.prune(runner.checkpoint_dir, runner.run.keep_last, keep=self.best(runner.checkpoint_dir, metric))

    def best(self, ckpt_dir: Path, metric: str | None) -> Path | None:
        """The complete checkpoint with the best recorded ``metric`` (None if none has a score for it)."""
        scored = []
        for tag_dir in Path(ckpt_dir).glob("step_*"):
            score_file = tag_dir / self.SCORE_FILE
            if metric and ckpt.is_complete(tag_dir) and score_file.is_file():
                info = json.loads(score_file.read_text())
                if info.get("metric") == metric and isinstance(info.get("value"), (int, float)):
                    sign = -1 if info["higher_is_better"] else 1
                    scored.append((sign * info["value"], int(tag_dir.name.removeprefix("step_")), tag_dir))
        return min(scored)[2] if scored else None  # ties: the earliest step


class TestGeneration(Hook):
    """Generate answers for `run.test_splits`; log their metrics (`run.test_metrics` or the section's `metrics`),
    a few sample lines, and the predictions file."""

    def __init__(self, logger: MetricsLogger) -> None:
        self.logger = logger

    def after_train(self, runner) -> None:
        self.test(runner)

    def evaluate(self, runner) -> None:
        self.test(runner)

    def test(self, runner) -> None:
        for split in runner.run.test_splits:
            scores, results = score_split(runner, split, TEST)
            samples = results[: runner.run.num_log_samples]
            self.logger.log(runner, {"split": split, **scores, "samples": samples})
            if runner.rank == 0:
                for s in samples:
                    tqdm.write(f"  {s['image']}: expected {s['expected']!r}, generated {s['generated']!r}")
        comm.barrier()
