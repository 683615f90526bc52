"""What happens around the loop: logging, evaluation, checkpoints, trackers - each a registered hook.

The built-in hooks (``BUILTIN_HOOKS``) always run, first, in a fixed order; the optional ones listed in
`run.hooks` (trackers, a user's own registered under `imports:`) follow in list order. Events, the order
they reach the hooks, and how a hook logs a record or asks for a checkpoint: ``base``; see docs/hooks.md.
"""
# Importing each module registers its hooks: the registry is complete after `import lavis_ds.runners`.
from lavis_ds.runners.hooks import checkpoints, evaluation, lmms_eval_hook, metrics_log, trackers  # noqa: F401
from lavis_ds.runners.hooks.base import SAVE_EVENTS, Hook, HookList
from lavis_ds.runners.hooks.build import BUILTIN_HOOKS, build_hooks, hook_problems, hook_specs
from lavis_ds.runners.hooks.checkpoints import BestCheckpoint, Checkpointer
from lavis_ds.runners.hooks.evaluation import TestGeneration, Validation, score_split, write_predictions
from lavis_ds.runners.hooks.lmms_eval_hook import LmmsEval
from lavis_ds.runners.hooks.metrics_log import MetricsLog
from lavis_ds.runners.hooks.trackers import MLflow, TensorBoard, Tracker, Wandb

__all__ = ["BUILTIN_HOOKS", "SAVE_EVENTS", "BestCheckpoint", "Checkpointer", "Hook", "HookList", "LmmsEval", "MLflow",
           "MetricsLog", "TensorBoard", "TestGeneration", "Tracker", "Validation", "Wandb", "build_hooks",
           "hook_problems", "hook_specs", "score_split", "write_predictions"]
