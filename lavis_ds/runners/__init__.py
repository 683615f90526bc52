"""Runners: the shared training loop (base.py) and the engines behind it."""
from lavis_ds.runners.base import RunnerBase
from lavis_ds.runners.deepspeed import DeepSpeedRunner
from lavis_ds.runners.fsdp import FSDPRunner

DEFAULT_RUNNER = "runner_deepspeed"  # the engine of a run that names none (run.runner)

__all__ = ["RunnerBase", "DeepSpeedRunner", "FSDPRunner", "DEFAULT_RUNNER"]
