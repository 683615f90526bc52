"""The plan the trainer hands an engine's ``wrap``: the checkpoint a run continues and its batch layout.

Its own module below the engine, so that ``runners/engine.py`` names it without importing ``runners/resume.py``,
which decides the plan by asking the engine (the layers stay one-way: resume -> engine -> this).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ResumePlan:
    """What a run continues and how its batches are laid out: decided before the engine is wrapped, which
    depends on it (an elastic resume changes the accumulation; another engine's checkpoint loads otherwise)."""

    source: tuple[Path, str] | None  # (load_dir, tag) of the checkpoint to continue; None: a fresh start
    micro_batch: int
    accum: int
    global_batch: int
    elastic: bool = False  # saved by another number of processes: same global batch, other accumulation
    handover_from: type | None = None  # the engine class that wrote it, if another engine's (runners/handover.py)

    @property
    def tag_dir(self) -> Path | None:
        return None if self.source is None else self.source[0] / self.source[1]
