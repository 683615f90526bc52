"""The built-in hook that writes metrics.jsonl and draws the progress bar."""
from __future__ import annotations

import time

from tqdm import tqdm

from lavis_ds.common.logger import MetricsWriter
from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.runners.hooks.base import Hook


@hook_registry.register("metrics_log")
class MetricsLog(Hook):
    """metrics.jsonl on rank 0 (every record: training steps every `run.log_freq` steps, evaluations), and a
    progress bar with ETA. It makes the training records; trackers (``run.hooks``) receive them too."""

    def __init__(self) -> None:
        self.writer, self.bar = None, None

    def before_train(self, runner) -> None:
        if runner.rank != 0:
            return
        resumed = runner.state.global_step if runner.state.global_step else None
        self.writer = MetricsWriter(runner.output_dir, resume_step=resumed)
        self.bar = tqdm(total=runner.total_steps, initial=runner.state.global_step, desc="train",
                        dynamic_ncols=True, mininterval=1.0)
        self.last_time, self.last_step = time.perf_counter(), runner.state.global_step

    def after_step(self, runner, metrics: dict) -> None:
        if runner.rank != 0:
            return
        self.bar.update(1)
        step = runner.state.global_step
        if step % runner.run.log_freq and step != runner.total_steps:
            return
        now = time.perf_counter()
        record = {"step": step, "epoch": runner.state.epoch, **metrics,
                  "samples_per_sec": (step - self.last_step) * runner.global_batch / max(now - self.last_time, 1e-9)}
        self.last_time, self.last_step = now, step
        runner.hooks.log(record)
        if record["loss"] is not None:  # None: a skipped step (non-finite loss)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")

    def log(self, runner, record: dict) -> None:
        self.writer.write(record)
        if "split" not in record:
            return
        # An evaluation: one line on screen, and the samples of a test split under it.
        tqdm.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items() if k not in ("samples", "step", "epoch")))
        for s in record.get("samples", []):
            tqdm.write(f"  {s['image']}: expected {s['expected']!r}, generated {s['generated']!r}")

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
