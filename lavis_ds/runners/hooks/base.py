"""What a hook is, and the one place events reach the hooks of a run.

A hook reacts to events of the run; every method is optional. While an event is being dispatched, a
hook never calls into another hook or into ``trainer.save()``: it *logs* a record
(``trainer.hooks.log``) and *asks* for a checkpoint (``trainer.request_save``). After every hook has
handled the event, the records logged meanwhile go to every hook's ``log``, in the order they were
logged, and then the loop cuts the checkpoint that was asked for, once (``Trainer.call_hooks``),
whose ``after_save`` goes to every hook in its turn. So no handler runs inside another one, and the
numbers of a step are in metrics.jsonl (and the trackers) before a checkpoint of that step exists.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator


class Hook:
    """Override what the hook reacts to. A registered hook's constructor arguments are its options in
    ``run.hooks`` (checked against its signature when the config is loaded)."""

    # Python packages the hook imports, {module: pip package}: a missing one is a config error naming the package.
    REQUIRES: dict[str, str] = {}

    def before_train(self, trainer) -> None:
        """The run starts (after a resume: ``trainer.state`` is where it continues); also before ``evaluate``."""

    def after_step(self, trainer, metrics: dict) -> None:
        """An optimizer step is done: ``metrics`` has its loss (None if skipped), lr and grad_norm."""

    def after_epoch(self, trainer) -> None:
        """An epoch is done (``trainer.state.epoch`` counts it)."""

    def log(self, trainer, record: dict) -> None:
        """A record was logged (rank 0 only): a training step's numbers every ``run.log_freq`` steps, or an
        evaluation's (its ``split`` key names the split). It has ``step`` and ``epoch``."""

    def after_save(self, trainer, tag_dir: Path) -> None:
        """A checkpoint is complete in ``tag_dir`` (every rank)."""

    def after_train(self, trainer) -> None:
        """The last epoch is done (the final test generation runs here)."""

    def on_stop(self, trainer, signum: int) -> None:
        """SIGTERM/SIGINT stopped the run at a step boundary, on every rank."""

    def evaluate(self, trainer) -> None:
        """``run.evaluate``: evaluate the checkpoint named by ``run.resume``, no training."""

    def close(self, trainer) -> None:
        """The run is over, however it ended (an error included): release what the hook made."""


# The events after which a requested checkpoint is cut: the step counters say which step it holds.
SAVE_EVENTS = ("after_step", "after_epoch", "on_stop")


class HookList:
    """The hooks of a run in run order; dispatches events, queues records and save requests meanwhile."""

    def __init__(self, trainer, hooks: list[Hook]):
        self.trainer, self.hooks = trainer, list(hooks)
        self.event: str | None = None  # the event being dispatched
        self.records: list[dict] = []
        self.save_reasons: list[str] = []
        self.failure: Exception | None = None  # the first deferred failure, for the trainer's next agreement

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    def __getitem__(self, index: int) -> Hook:
        return self.hooks[index]

    def __len__(self) -> int:
        return len(self.hooks)

    def call(self, event: str, *args, **kwargs) -> list[str]:
        """Dispatch ``event`` to every hook in order, then deliver the records logged meanwhile; return why a
        checkpoint was asked for (empty: none was). A failing hook stops the dispatch; its records are dropped."""
        if self.event is not None:
            raise RuntimeError(f"hook event {event!r} dispatched while {self.event!r} is: a hook must not dispatch "
                               "events (log records with trainer.hooks.log, ask for saves with trainer.request_save)")
        self.event = event
        try:
            for hook in self.hooks:
                getattr(hook, event)(self.trainer, *args, **kwargs)
            self._deliver()
            return self.save_reasons
        finally:
            self.event, self.records, self.save_reasons = None, [], []

    def log(self, record: dict) -> None:
        """Hand ``record`` to every hook's ``log``: after the event being dispatched, else at once. Records exist
        on rank 0 only, the process that holds the gathered scores; other ranks' are dropped."""
        if self.trainer.rank != 0:
            return
        self.records.append(record)
        if self.event is not None:
            return
        self.event = "log"  # outside any event (between two): deliver now, records logged meanwhile after it
        try:
            self._deliver()
        finally:
            self.event, self.records = None, []

    def defer(self, error: Exception) -> None:
        """Keep a failure of work done on one rank only (rank 0 writing metrics.jsonl or predictions) for the
        trainer's next agreement, where every rank stops with it (``faults.agree``). Raising at once would stop
        rank 0 alone, while the others wait for it in their next collective."""
        self.failure = self.failure or error

    def take_failure(self) -> Exception | None:
        """The deferred failure, once."""
        failure, self.failure = self.failure, None
        return failure

    def request_save(self, reason: str) -> None:
        """Ask for a checkpoint of the current step, cut once the event is dispatched (``Trainer.call_hooks``)."""
        if self.event not in SAVE_EVENTS:
            raise RuntimeError(f"a checkpoint was requested ({reason}) during {self.event or 'no event'}; a hook "
                               f"asks for one in {', '.join(SAVE_EVENTS)} (its step is then settled)")
        self.save_reasons.append(reason)

    def _deliver(self) -> None:
        # A hook may log while handling a record: that record goes out after the current one, to every hook.
        while self.records:
            record = self.records.pop(0)
            for hook in self.hooks:
                hook.log(self.trainer, record)
