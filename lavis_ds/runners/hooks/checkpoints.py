"""The built-in checkpoint hooks: when to save, and which checkpoint is the best."""
from __future__ import annotations

import json
import signal
from pathlib import Path

from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.metrics.selection import LMMS_EVAL_SPLIT, higher_is_better
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.hooks.base import Hook


@hook_registry.register("checkpointer")
class Checkpointer(Hook):
    """Asks for a checkpoint every `run.save_freq_steps` optimizer steps, at each epoch end, and when SIGTERM
    stops the run; the loop cuts it once every hook has seen the event (``Trainer.call_hooks``), so the
    validation of that step (at any place in the list) is done and logged before it."""

    def __init__(self, save_freq_steps: int = 0) -> None:
        self.save_freq_steps = save_freq_steps  # run.save_freq_steps (0: at epoch ends only)

    def after_step(self, trainer, metrics: dict) -> None:
        freq = self.save_freq_steps
        at_epoch_end = trainer.state.step_in_epoch == trainer.data.steps_per_epoch  # after_epoch asks for that one
        if freq and trainer.state.global_step % freq == 0 and not at_epoch_end:
            trainer.request_save("run.save_freq_steps")

    def after_epoch(self, trainer) -> None:
        trainer.request_save("epoch end")

    def on_stop(self, trainer, signum: int) -> None:
        # SIGTERM is preemption: save where every rank stopped (the loop skips a step saved already).
        # SIGINT is a user's Ctrl-C: stop without writing anything.
        if signum == signal.SIGTERM and trainer.state.global_step:
            trainer.request_save("SIGTERM")


@hook_registry.register("best_checkpoint")
class BestCheckpoint(Hook):
    """Owns "the best checkpoint": scores each one by `run.best_metric` and prunes to `run.keep_last` + the best.

    A checkpoint cut at the step of a validation gets ``lavis_ds_score.json`` (metric, value, direction);
    the best is read back from those files, so it survives a resume. `run.best_metric` defaults to the
    first valid split's loss (lower is better); a metric says its own direction (CIDEr: higher; an lmms-eval
    score: its record's ``higher_is_better``). The scores come from the validation and lmms-eval records (``log``),
    which reach every hook before the checkpoint is cut.
    """

    SCORE_FILE = "lavis_ds_score.json"

    def __init__(self, metric: str | None = None, valid_splits: tuple[str, ...] = (), keep_last: int = 0) -> None:
        """``metric``: run.best_metric (None: the first valid split's loss); ``keep_last``: run.keep_last (0: keep
        every checkpoint)."""
        self.valid_splits, self.keep_last = tuple(valid_splits), keep_last
        self.metric = metric or (f"{self.valid_splits[0]}/loss" if self.valid_splits else None)
        self.latest: dict = {}  # {"step": N, "scores": {"val/loss": ..., "val/caption/CIDEr": ...}}
        self.directions: dict[str, bool] = {}  # what the records say of their metrics' direction (lmms-eval's)

    def log(self, trainer, record: dict) -> None:
        if record.get("split") not in (*self.valid_splits, LMMS_EVAL_SPLIT):
            return
        if self.latest.get("step") != record["step"]:
            self.latest = {"step": record["step"], "scores": {}}
        split = record["split"]
        self.latest["scores"].update({f"{split}/{k}": v for k, v in record.items() if isinstance(v, float)})
        self.directions.update(record.get("higher_is_better") or {})

    def after_save(self, trainer, tag_dir: Path) -> None:
        if trainer.rank != 0:
            return
        metric, latest = self.metric, self.latest
        if metric and latest.get("step") == trainer.state.global_step and metric in latest["scores"]:
            higher = self.directions.get(metric, higher_is_better(metric))
            info = {"metric": metric, "value": latest["scores"][metric], "higher_is_better": higher}
            (Path(tag_dir) / self.SCORE_FILE).write_text(json.dumps(info, indent=2))
        if self.keep_last:
            ckpt.prune(trainer.checkpoint_dir, self.keep_last, keep=self.best(trainer.checkpoint_dir, metric))

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
