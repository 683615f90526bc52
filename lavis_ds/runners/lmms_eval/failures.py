"""An evaluation in the loop that fails on one rank: every rank hears of it and stops, or every rank trains on.

lmms-eval runs each rank's share of the requests, gathers the per-document results to rank 0, scores them there
(``evaluate``'s aggregation: the tasks' own aggregation functions) and ends with a barrier on the run's process
group. A rank that raises out of it alone leaves the others waiting in a collective until the NCCL timeout (tens
of minutes by default), and the error it printed is lost among their timeout tracebacks. So the ``lmms_eval`` hook
and ``lavis-ds eval`` on several processes catch a failure on the rank it happens on and the ranks agree on it at
once, in one collective (:func:`agree_on_evaluation`); a rank 0 that failed while scoring first meets the barrier
the others wait at (:func:`meet_closing_barrier`), and a rank that cannot prepare one of its requests holds that
failure until lmms-eval is done (``LavisDsLmms``'s ``hold_failures``), joining the others' forwards and gathers
meanwhile. Under lmms-eval's own command line, which catches an evaluation's error on each rank and calls no
lavis_ds after it, the ranks agree at the end of each request method instead (``LavisDsLmms``'s
``agree_per_call``). A failure inside a forward on one rank (a sharded forward is itself a collective), or inside
lmms-eval's per-document scoring on one rank before its gathers, is not recovered: that rank raises, as any rank
failing inside a collective does.

No lmms-eval import here: a failure is read from its traceback.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lavis_ds.common import comm, dist
from lavis_ds.common.errors import LavisDsError, message_of, report
from lavis_ds.runners import faults

# What lmms-eval 0.7.3's ``evaluate`` calls on rank 0 alone, after its last gather and before its closing barrier:
# a failure inside one of them leaves every other rank waiting at that barrier.
RANK0_SCORING = frozenset({"calculate_aggregate_metric", "calculate_clt_aggregate_metric",
                           "calculate_stability_metrics", "consolidate_results", "consolidate_group_results",
                           "prepare_print_tasks", "get_subtask_list"})
TRAIN_ON = "training continues without this evaluation's scores (run.lmms_eval.on_error: continue)"
STOP = "the run stops here; set run.lmms_eval.on_error: continue to train on when an evaluation fails"


class EvaluationFailed(LavisDsError):
    """A benchmark evaluation in the loop failed (``exit_code``: its cause's, 2 for bad input)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):  # picklable although __init__ takes more than the message
        return type(self), (str(self), self.exit_code)

    @classmethod
    def from_error(cls, message: str, error: BaseException) -> "EvaluationFailed":
        """``message`` (the line every rank's agreement reports) with ``error``'s exit code (1 if it has none)."""
        return cls(message, getattr(error, "exit_code", 1))


def evaluation_failure(error: Exception, tasks: list[str], step: int, train_on: bool) -> EvaluationFailed:
    """``error`` as the one line every rank's agreement reports: the task the traceback names (else the
    evaluation's tasks), the optimizer step, the rank, the cause, and whether the run stops."""
    return EvaluationFailed.from_error(f"run.lmms_eval: {what_failed(error, tasks, f' at optimizer step {step}')}; "
                                       f"{TRAIN_ON if train_on else STOP}", error)


def what_failed(error: Exception, tasks: list[str], at: str = "") -> str:
    """``evaluating task T<at> failed on rank R: <cause>``: the task the traceback names (else the evaluation's
    tasks), the rank and the cause; the part of the line the ``lmms_eval`` hook and ``lavis-ds eval`` share."""
    task = task_of(error)
    what = f"task {task}" if task else f"task{'s' if len(tasks) > 1 else ''} {', '.join(tasks)}"
    return f"evaluating {what}{at} failed on rank {dist.rank()}: {cause_of(error)}"


def cause_of(error: Exception) -> str:
    """A lavis_ds error's message; anything else's type and message."""
    return message_of(error) if isinstance(error, LavisDsError) else f"{type(error).__name__}: {message_of(error)}"


def task_of(error: BaseException) -> str | None:
    """The lmms-eval task whose code raised ``error``, innermost first: a frame of a ``TaskOutput`` (scoring) or a
    task (``config.task``: its documents, its results); None if no frame names one."""
    names = []
    traceback = error.__traceback__
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        name = getattr(owner, "task_name", None) or getattr(getattr(owner, "config", None), "task", None)
        if isinstance(name, str):
            names.append(name)
        traceback = traceback.tb_next
    return names[-1] if names else None


def meet_closing_barrier(error: BaseException) -> None:
    """Rank 0 failed while lmms-eval scored on it alone: the other ranks wait at lmms-eval's closing barrier on the
    run's process group; join it (the call lmms-eval makes there) so that they reach the agreement."""
    if dist.rank() != 0 or dist.world_size() < 2:
        return
    traceback, inside_evaluate = error.__traceback__, False
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if inside_evaluate and code.co_name in RANK0_SCORING:
            comm.default_group_barrier()
            return
        inside_evaluate = (code.co_name == "evaluate"
                           and traceback.tb_frame.f_globals.get("__name__") == "lmms_eval.evaluator")
        traceback = traceback.tb_next


def agree_on_evaluation(failure: EvaluationFailed | None, train_on: bool) -> bool:
    """Collective, every rank after every evaluation: whether it failed on any rank. Failed: with ``train_on``
    rank 0 reports the lowest failing rank's line and every rank returns True; else every rank raises (that rank
    its own ``failure``, the others ``faults.PeerFailed`` with its message, silently)."""
    failed = comm.all_reduce(torch.tensor([failure is not None], dtype=torch.int64), op="max")
    if not int(failed[0]):
        return False
    if not train_on:
        faults.raise_together(failure)
    lines = comm.all_gather_object(None if failure is None else str(failure))
    if dist.rank() == 0:
        report(next(line for line in lines if line is not None))
    return True


def evaluated_together(evaluate: Callable[[], Any], failure_of: Callable[[Exception], EvaluationFailed],
                       train_on: bool) -> tuple[Any, bool]:
    """Collective, every rank: ``evaluate()`` here, then the ranks' agreement on whether it failed on any of them
    (:func:`agree_on_evaluation`; ``failure_of`` makes this rank's line of what it raised, after it met the closing
    barrier a failed rank 0 owes the others). Returns ``evaluate()``'s result (None where it failed here) and
    whether it failed anywhere, which only ``train_on`` returns: else every rank raises."""
    result, failure = None, None
    try:
        result = evaluate()
    except Exception as e:  # told to every rank by the agreement, rather than leaving them waiting for this one
        meet_closing_barrier(e)
        failure = failure_of(e)
    return result, agree_on_evaluation(failure, train_on)
