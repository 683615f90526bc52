"""What happens around the loop: logging, evaluation, checkpoints.

Each hook reacts to before_train / after_step / after_epoch / after_train, and
on_stop (a SIGTERM/SIGINT stops the run at a step boundary). Their order in
`build_hooks` is their run order.
"""
from __future__ import annotations

import signal
import time

import torch.distributed as torch_dist
from tqdm import tqdm

from lavis_ds.common.logger import MetricsWriter


class Hook:
    def before_train(self, runner) -> None: ...

    def after_step(self, runner, metrics: dict) -> None: ...

    def after_epoch(self, runner, evaluate_only: bool = False) -> None: ...

    def after_train(self, runner) -> None: ...

    def on_stop(self, runner, signum: int) -> None: ...


def build_hooks(runner) -> list[Hook]:
    return [
        # Logging first: a step's numbers are on disk before a checkpoint can be cut at that step.
        MetricsLogger(),
        # Validation before the epoch-end checkpoint, so the checkpoint's metrics.jsonl holds its result.
        Validation(),
        Checkpointer(),
        # Generation-based test metrics once, at the very end.
        TestGeneration(),
    ]


class MetricsLogger(Hook):
    """metrics.jsonl + TensorBoard on rank 0 every `run.log_freq` steps, and a progress bar with ETA."""

    def before_train(self, runner) -> None:
        runner.writer = None
        if runner.rank != 0:
            return
        resumed = runner.state.global_step if runner.state.global_step else None
        runner.writer = MetricsWriter(runner.output_dir, resume_step=resumed)
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
        runner.writer.write(record)
        if record["loss"] is not None:  # None: a skipped step (non-finite loss)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")

    def after_train(self, runner) -> None:
        if runner.rank == 0:
            self.bar.close()  # the writer stays open for later hooks; the runner closes it

    def on_stop(self, runner, signum: int) -> None:
        self.after_train(runner)


def _log(runner, record: dict) -> None:
    if runner.rank == 0:
        runner.writer.write({"step": runner.state.global_step, "epoch": runner.state.epoch, **record})
        tqdm.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items() if k != "samples"))


class Validation(Hook):
    """Validation loss on each of `run.valid_splits` at the end of every epoch."""

    def after_epoch(self, runner, evaluate_only: bool = False) -> None:
        for i, split in enumerate(runner.run.valid_splits):
            result = runner.evaluate_loss(split)
            _log(runner, {"split": split, **result})
            if i == 0:  # the first valid split picks the best checkpoint (run.keep_last keeps it)
                runner.validation = {"step": runner.state.global_step, "loss": result["loss"]}


class Checkpointer(Hook):
    """Every `run.save_freq_steps` optimizer steps, at each epoch end, and when SIGTERM stops the run."""

    def after_step(self, runner, metrics: dict) -> None:
        freq = runner.run.save_freq_steps
        at_epoch_end = runner.state.step_in_epoch == runner.steps_per_epoch  # after_epoch saves that one
        if freq and runner.state.global_step % freq == 0 and not at_epoch_end:
            runner.save()

    def after_epoch(self, runner, evaluate_only: bool = False) -> None:
        if not evaluate_only:
            runner.save()

    def on_stop(self, runner, signum: int) -> None:
        # SIGTERM is preemption: save where every rank stopped, unless that step is saved already.
        # SIGINT is a user's Ctrl-C: stop without writing anything.
        if signum == signal.SIGTERM and runner.state.global_step not in (0, runner.saved_step):
            runner.save()


class TestGeneration(Hook):
    """Generate answers for `run.test_splits`; log exact-match accuracy and a few sample lines."""

    def after_train(self, runner) -> None:
        for split in runner.run.test_splits:
            results = runner.generate_split(split)
            correct = sum(_normalise(r["generated"]) == _normalise(r["expected"]) for r in results)
            samples = results[: runner.run.num_log_samples]
            _log(runner, {"split": split, "exact_match": correct / max(1, len(results)),
                          "num_samples": len(results), "samples": samples})
            if runner.rank == 0:
                for s in samples:
                    tqdm.write(f"  {s['image']}: expected {s['expected']!r}, generated {s['generated']!r}")
        if torch_dist.is_initialized():
            torch_dist.barrier()


def _normalise(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())
