"""DeepSpeed itself, imported once per process without mlflow: its autotuner imports mlflow when installed, more
than a second per process, and lavis_ds never runs the autotuner (``lavis_ds.common.imports``).

Every function here that imports from ``deepspeed`` calls :func:`load_deepspeed` first: whichever runs first in a
process (the config check, an export, the ops build) then imports it this way."""
from __future__ import annotations

from types import ModuleType

from lavis_ds.common.imports import import_without


def load_deepspeed() -> ModuleType:
    return import_without("deepspeed", ("mlflow",))
