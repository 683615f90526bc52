"""Importing a library without the optional packages it loads for features lavis_ds never calls.

DeepSpeed's autotuner imports ``mlflow`` and timm's summary helper imports ``wandb`` whenever they are installed
(lavis_ds's ``trackers`` extra installs both). Importing them costs more than a second of CPU in every process that
starts: every rank of every launch, every chat and export. lavis_ds runs neither the autotuner nor timm's summary,
and its tracker hooks import ``mlflow`` and ``wandb`` themselves when a run names them.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_without(module: str, unused: tuple[str, ...]) -> ModuleType:
    """Import ``module`` with ``unused`` looking absent to it (``import`` of a ``None`` in ``sys.modules`` raises
    ImportError, which both libraries catch); afterwards they import as usual. A package that is already imported
    stays visible: hiding it then would save nothing."""
    if module in sys.modules:
        return sys.modules[module]
    hidden = [name for name in unused if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        return importlib.import_module(module)
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
