"""The built-in hook `lmms_eval`: benchmarks in the loop, run by lmms-eval on the live model (`run.lmms_eval`).

Every rank takes its share of each task's requests (lmms-eval's own sharding by rank) and runs its forwards
through the engine, which gathers what a sharded engine needs (ZeRO-3, FSDP2): every rank joins every forward.
lmms-eval gathers the results to rank 0 once, with its own collectives on the process group; rank 0 logs one
record per evaluation (split ``lmms_eval``: metrics.jsonl, the trackers, ``run.best_metric``) and writes the
per-document predictions. A run killed during an evaluation has no checkpoint of that step yet (the loop saves
after every hook has handled the step), so the rerun trains the step again and evaluates it again; metrics.jsonl
drops the lines past the resumed step, and the predictions files are replaced whole: one row, one file.
An evaluation that fails on any rank (a task's scoring on rank 0, say) is agreed on by every rank right after it
(``lmms_eval.failures``): every rank stops with one line naming the task and the step, or, with `on_error:
continue`, the evaluation is left without a record and every rank trains on.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from lavis_ds.common.errors import OutputError
from lavis_ds.common.modes import eval_mode
from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.hooks.base import Hook
from lavis_ds.runners.hooks.evaluation import write_json_lines
from lavis_ds.runners.hooks.lmms_eval_checks import SPLIT, scores_of, task_index
from lavis_ds.runners.lmms_eval.failures import evaluated_together, evaluation_failure


EVAL_SEED = 0  # lmms-eval's python, numpy, torch and few-shot seeds, as `lavis-ds eval` sets them by default


@hook_registry.register("lmms_eval")
class LmmsEval(Hook):
    """Evaluates the live model on `run.lmms_eval.tasks` every `every` optimizer steps or at every epoch end (and
    in `run.evaluate`); logs each evaluation's scores, its documents (``num_samples``, over all tasks), its seconds
    and its share of the wall time since the previous one. Does nothing when `run.lmms_eval` is unset."""

    def __init__(self, tasks: tuple[str, ...] = (), every: int | str = "epoch", limit: int | float | None = None,
                 num_fewshot: int | None = None, batch_size: int = 1, include_path: str | None = None,
                 on_error: str = "stop") -> None:
        """The keys of `run.lmms_eval` (``lmms_eval_checks.LmmsEvalSettings``, checked with the config)."""
        self.tasks, self.every, self.limit = list(tasks), every, limit
        self.num_fewshot, self.batch_size = num_fewshot, batch_size
        self.include_path = str(Path(include_path).expanduser()) if include_path else None
        self.train_on = on_error == "continue"  # an evaluation that fails: no scores, the run goes on
        self.since: float | None = None  # when the wall time the next evaluation's share is of began

    def before_train(self, trainer) -> None:
        self.since = time.perf_counter()

    def after_step(self, trainer, metrics: dict) -> None:
        if isinstance(self.every, int) and trainer.state.global_step % self.every == 0:
            self.benchmark(trainer)

    def after_epoch(self, trainer) -> None:
        if self.every == "epoch":
            self.benchmark(trainer)

    def evaluate(self, trainer) -> None:
        self.benchmark(trainer)

    def benchmark(self, trainer) -> None:
        """Evaluate on the tasks (every rank), then agree that every rank did (a failure anywhere stops every rank, or
        with `on_error: continue` skips this evaluation's record), then log the record and write the predictions
        (rank 0)."""
        if not self.tasks:
            return
        started = time.perf_counter()

        def evaluate() -> tuple[dict | None, dict | None]:  # every rank; the results and the record on rank 0 only
            results = self.run_lmms_eval(trainer)
            return results, self._record(trainer, results, started) if trainer.rank == 0 else None

        outcome, failed = evaluated_together(
            evaluate, lambda e: evaluation_failure(e, self.tasks, trainer.state.global_step, self.train_on),
            self.train_on)
        if not failed and trainer.rank == 0:
            results, record = outcome
            trainer.hooks.log(record)
            self._write_predictions(trainer, results)
        self.since = time.perf_counter()

    def _record(self, trainer, results: dict, started: float) -> dict:
        """The evaluation's record: its scores, documents, seconds and share of the wall time (rank 0)."""
        seconds = time.perf_counter() - started
        scores, directions = scores_of(results)
        documents = sum(int(n.get("effective", 0)) for n in results.get("n-samples", {}).values())
        # the share of the wall time since the previous evaluation (or the start) that this one took
        share = seconds / max(seconds + started - (self.since or started), 1e-9)
        return {"step": trainer.state.global_step, "epoch": trainer.state.epoch, "split": SPLIT, **scores,
                "num_samples": documents, "seconds": seconds, "time_share": share, "higher_is_better": directions}

    def run_lmms_eval(self, trainer) -> dict | None:
        """lmms-eval's ``simple_evaluate`` on the live model, on every rank; its results on rank 0, else None.

        The global random states are kept: lmms-eval seeds python, numpy and torch for its few-shot draws, and a
        run with benchmarks trains as one without.
        """
        from lmms_eval.evaluator import simple_evaluate

        model = live_model(trainer, self.batch_size)
        with _kept_random_states(), eval_mode(trainer.engine.module):
            results = simple_evaluate(
                model=model, tasks=list(self.tasks), limit=self.limit, num_fewshot=self.num_fewshot,
                batch_size=self.batch_size, task_manager=task_index(self.include_path, tuple(self.tasks)),
                log_samples=True,  # the per-document answers, for the predictions files
                # lavis-ds eval's seeds (its --seed default): a task that samples draws as it does there
                random_seed=EVAL_SEED, numpy_random_seed=EVAL_SEED, torch_random_seed=EVAL_SEED,
                fewshot_random_seed=EVAL_SEED,
                bootstrap_iters=0,  # no stderr resampling in the loop: the scores are the same, minutes faster
                # lmms-eval's collectives on the run's process group; "accelerate" would build one of its own
                distributed_executor_backend="torchrun")
        if model.failure is not None:  # a request this rank could not answer, held while the others needed it
            raise model.failure
        return results

    def _write_predictions(self, trainer, results: dict) -> None:
        """predictions/lmms_eval_<task>_step<N>.jsonl: each document's id, target, answer and scores (rank 0)."""
        step = trainer.state.global_step
        for task, samples in sorted((results.get("samples") or {}).items()):
            metrics = [key.split(",", 1)[0] for key in results["results"].get(task, {}) if "," in key]
            rows = [{"doc_id": s.get("doc_id"), "target": s.get("target"), "filtered_resps": s.get("filtered_resps"),
                     **{m: s[m] for m in metrics if m in s}} for s in sorted(samples, key=lambda s: s["doc_id"])]
            try:
                write_json_lines(trainer.output_dir / "predictions" / f"{SPLIT}_{task}_step{step}.jsonl", rows)
            except OutputError as e:  # rank 0 only: every rank stops at the next agreement (HookList.defer)
                trainer.hooks.defer(e)


def live_model(trainer, batch_size: int):
    """lmms-eval's model over the trainer's live model (``LavisDsLmms``): its forwards and generation go through the
    engine (which gathers what ZeRO-3 and FSDP2 shard), with the run's eval processors and `run.generate` under each
    task's own generation settings; a request one rank cannot answer is held until lmms-eval is done
    (``hold_failures``), so that rank still joins the others' forwards and gathers."""
    from lavis_ds.image_config import eval_processors_of
    from lavis_ds.runners.lmms_eval.model import LavisDsLmms

    image_processor, text_processor = eval_processors_of(trainer.cfg)
    return LavisDsLmms(trainer.engine.module, image_processor, text_processor, engine=trainer.engine,
                       batch_size=batch_size, generation=dict(trainer.run.generate), hold_failures=True)


@contextlib.contextmanager
def _kept_random_states():
    cpu = ckpt.rng_states()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        ckpt.restore_rng_states(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
