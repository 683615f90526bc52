"""Optimizer parameter groups and learning-rate schedules."""
from lavis_ds.optim import lr_schedulers  # noqa: F401  (registers the schedulers)
from lavis_ds.optim.param_groups import build_param_groups

__all__ = ["build_param_groups", "lr_schedulers"]
