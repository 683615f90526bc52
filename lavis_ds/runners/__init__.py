"""Runners: the shared training loop and the engines behind it.

``base`` (the loop and evaluation: ``RunnerBase``), ``engine`` (what an engine provides), ``resume`` (which
checkpoint a run continues), ``handover`` (continuing another engine's checkpoint), ``hooks``, ``checkpoint``
(the step_<N> folder protocol), ``faults``; one package per engine: ``deepspeed/`` and ``fsdp/``.
"""
from lavis_ds.runners.base import RunnerBase
from lavis_ds.runners.deepspeed import DeepSpeedRunner
from lavis_ds.runners.fsdp import FSDPRunner

DEFAULT_RUNNER = "runner_deepspeed"  # the engine of a run that names none (run.runner)

__all__ = ["RunnerBase", "DeepSpeedRunner", "FSDPRunner", "DEFAULT_RUNNER"]
