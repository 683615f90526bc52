"""The built-in hooks that write metrics.jsonl, draw the progress bar, and time the training for throughput."""
from __future__ import annotations

from tqdm import tqdm

from lavis_ds.common.errors import OutputError
from lavis_ds.common.logger import MetricsWriter
from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.runners.hooks.base import Hook
from lavis_ds.runners.throughput import ThroughputMeter


@hook_registry.register("metrics_log")
class MetricsLog(Hook):
    """metrics.jsonl on rank 0 (every record: training steps every `run.log_freq` steps, evaluations), and a
    progress bar with ETA. It makes the training records; trackers (``run.hooks``) receive them too.

    Each logged step carries its throughput since the last one (``runners.throughput``: tokens/s, padding
    share, peak memory, MFU), summed over the ranks at the logged step.
    """

    def __init__(self, log_freq: int = 10, peak_tflops: float | None = None, precision: str | None = None) -> None:
        """run.log_freq (optimizer steps between logged records); run.peak_tflops and run.precision: what the
        logged MFU divides by (``throughput.peak_tflops``)."""
        self.log_freq = log_freq
        self.writer, self.bar = None, None
        self.last_step = 0  # the run's (before_train's): always logged
        self.meter = ThroughputMeter(peak_tflops, precision)

    def before_train(self, trainer) -> None:
        self.last_step = trainer.total_steps  # once: every step compares with it
        if trainer.rank == 0:
            resumed = trainer.state.global_step if trainer.state.global_step else None
            try:
                self.writer = MetricsWriter(trainer.output_dir, resume_step=resumed)
            except OutputError as e:  # every rank stops right after before_train (Trainer.call_hooks)
                trainer.hooks.defer(e)
            self.bar = tqdm(total=trainer.total_steps, initial=trainer.state.global_step, desc="train",
                            dynamic_ncols=True, mininterval=1.0)
        self.meter.start(trainer.engine.module, trainer.rank)

    def after_step(self, trainer, metrics: dict) -> None:
        metrics = dict(metrics)
        self.meter.step_done(metrics.pop("tokens", None))  # every rank: its own tokens
        if trainer.rank == 0:
            self.bar.update(1)
        step = trainer.state.global_step
        if step % self.log_freq and step != self.last_step:
            return
        throughput = self.meter.report(trainer)  # collective: every rank takes the same steps
        if trainer.rank != 0:
            return
        record = {"step": step, "epoch": trainer.state.epoch, **metrics, **throughput}
        trainer.hooks.log(record)
        if record["loss"] is not None:  # None: a skipped step (non-finite loss)
            # Shown at the bar's next refresh (every second at most), not by a write of its own on this step.
            self.bar.set_postfix(_postfix(record), refresh=False)

    def log(self, trainer, record: dict) -> None:
        try:
            if self.writer is not None:  # None: it could not be opened, and the run is stopping
                self.writer.write(record)
        except OutputError as e:  # rank 0 only: every rank stops at the next agreement (HookList.defer)
            trainer.hooks.defer(e)
        if "split" not in record:
            return
        # An evaluation: one line on screen, and the samples of a test split under it.
        tqdm.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items() if k not in ("samples", "step", "epoch", "higher_is_better")))
        for s in record.get("samples", []):
            tqdm.write(f"  {s['image']}: expected {s['expected']!r}, generated {s['generated']!r}")

    def after_train(self, trainer) -> None:
        self._close_bar()  # the writer stays open for the final tests

    def on_stop(self, trainer, signum: int) -> None:
        self._close_bar()

    def close(self, trainer) -> None:
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


@hook_registry.register("training_clock")
class TrainingClock(Hook):
    """Restarts the throughput clock of ``metrics_log`` once a step's or an epoch's evaluations are done, and after
    every save, so that neither counts as training time in tokens/s and MFU. The last built-in hook."""

    def __init__(self) -> None:
        self.meter: ThroughputMeter | None = None

    def before_train(self, trainer) -> None:
        self.meter = next(hook.meter for hook in trainer.hooks if isinstance(hook, MetricsLog))

    def after_step(self, trainer, metrics: dict) -> None:
        self.meter.mark()

    def after_epoch(self, trainer) -> None:
        self.meter.mark()

    def after_save(self, trainer, tag_dir) -> None:
        self.meter.mark()
