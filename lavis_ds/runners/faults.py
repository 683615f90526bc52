"""What stops a run, decided by every rank together: signals, samples that fail to load, non-finite losses.

A rank that stops alone leaves the others blocked in their next collective. So the
loop asks once per optimizer step, before the step's forward, with a few small integers
(`step_flags`): has any rank received SIGTERM/SIGINT, has any rank failed to load its
micro-batches or to run a hook? The step's supervised tokens, which the loss normalisation
needs, ride along. Every rank then stops at the same step, and a failure travels to every
rank with its message (printed once, by the rank that failed).

One collective per step, not two: within an epoch the next step's micro-batches are loaded
before this step's loss check, and its agreement rides on that all-reduce, which every step
makes anyway (non-finite losses are decided there). What it decides is acted on once this step
is done, so a run still stops between the same two steps; only a signal or a hook failure that
comes after the check (during the optimizer step or the after_step hooks) is seen one step
later. An epoch's first step agrees alone (`agree_on_step`). Between steps (after hooks, around
saves) `agree` asks the same about a failure alone.
"""
from __future__ import annotations

import signal

import torch

from lavis_ds.common import comm, dist
from lavis_ds.common.errors import LavisDsError, message_of, report

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(LavisDsError):
    """The run stopped at a step boundary because of a signal. Exit 128 + signal, as a shell reports it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


class NonFiniteLoss(LavisDsError):
    """A NaN/inf loss with `run.on_nonfinite: stop`. Raised on every rank before the optimizer step."""


class PeerFailed(LavisDsError):
    """Another rank failed; it prints the message, this rank exits with the same code, silently."""

    def __init__(self, rank: int, message: str, exit_code: int):
        super().__init__(f"rank {rank} failed: {message}")
        self.exit_code, self.quiet = exit_code, True


class SignalCatcher:
    """SIGTERM/SIGINT ask the run to stop at the next step boundary; a second one stops it at once.

    SLURM and Kubernetes send SIGTERM before they kill a job; torchrun forwards the
    SIGTERM or SIGINT it gets to every worker. ``received`` is the first signal (0: none).
    """

    def __init__(self):
        self.received = 0
        self._previous = {}

    def __enter__(self) -> "SignalCatcher":
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.received:
            raise KeyboardInterrupt  # the second signal: the user does not want to wait
        self.received = signum
        then = "save a checkpoint and exit" if signum == signal.SIGTERM else "exit without saving"
        report(f"received {signal.Signals(signum).name}: finishing the current optimizer step, then {then} "
               "(send it again to stop at once)")


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader workers leave SIGTERM/SIGINT to the main process, which stops at a step boundary.

    A worker killed by them (SLURM signals every process, Ctrl-C the whole process
    group) would end the run with "DataLoader worker exited unexpectedly" instead.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def agree(stop: int, error: BaseException | None = None) -> int:
    """Collective, once per optimizer step: the stop signal any rank received (0: none).

    Raises on every rank if any rank passes an ``error``: that rank its own, the
    others :class:`PeerFailed` with its message and exit code.
    """
    flags = comm.all_reduce(torch.tensor([stop, error is not None], dtype=torch.int64), op="max")
    if flags[1]:
        raise_together(error)
    return int(flags[0])


def agree_on_step(stop: int, error: BaseException | None, counts: list[int] | None
                  ) -> tuple[int, list[int] | None]:
    """Collective: ``agree`` and this rank's ``counts`` (the objective's units of the step: supervised tokens,
    pairs) summed over every rank, in one all-reduce of ``step_flags`` (None: this step counts none). Raises as
    ``agree`` does. The loop makes it alone only for an epoch's first step; the others' ride on the previous
    step's loss check (``losses.LossCheck``) and are read by ``read_step_flags``."""
    totals = comm.all_reduce(torch.tensor(step_flags(stop, error, counts), dtype=torch.int64)).tolist()
    return read_step_flags(totals, error, counts)


def step_flags(stop: int, error: BaseException | None, counts: list[int] | None) -> list[int]:
    """What this rank contributes to a step's agreement, summed over every rank: per stop signal whether it received
    it, whether it failed, its counts. A sum carries everything: the first of STOP_SIGNALS received anywhere wins
    (as SIGTERM's save wins over SIGINT's exit in ``agree``'s max), any failed rank fails the step."""
    return [int(stop == signum) for signum in STOP_SIGNALS] + [int(error is not None)] + list(counts or [])


def read_step_flags(totals: list[int], error: BaseException | None, counts: list[int] | None
                    ) -> tuple[int, list[int] | None]:
    """The agreed stop signal (0: none) and summed counts from ``step_flags``' totals; collective and raising on
    every rank (``raise_together``) if any rank failed."""
    if totals[len(STOP_SIGNALS)]:
        raise_together(error)
    signum = next((signum for signum, ranks in zip(STOP_SIGNALS, totals) if ranks), 0)
    return signum, None if counts is None else [int(total) for total in totals[len(STOP_SIGNALS) + 1:]]


def raise_together(error: BaseException | None) -> None:
    """Collective: every rank raises; the lowest failing rank's error is the one reported."""
    mine = None if error is None else (message_of(error), getattr(error, "exit_code", 1))
    gathered = comm.all_gather_object(mine)
    first = next(rank for rank, item in enumerate(gathered) if item is not None)
    if error is not None and first == dist.rank():
        raise error
    raise PeerFailed(first, *gathered[first])

