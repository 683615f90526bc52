"""The shared training loop (the trainer) and the engines it holds.

``trainer`` (the loop: ``Trainer``), ``engine`` (what an engine provides: ``Engine``), ``resume`` (which checkpoint
a run continues: a ``ResumePlan``), ``handover`` (continuing another engine's checkpoint), ``data`` (the training
data and evaluation batches), ``evaluation``, ``losses``, ``hooks``, ``checkpoint`` (the step_<N> folder protocol),
``faults``; one package per engine, each registered in ``registry.engines`` (``run.runner`` names one):
``deepspeed/`` and ``fsdp/``. The package keeps LAVIS's name, ``runners``.
"""
from lavis_ds.runners.deepspeed import DeepSpeedEngine
from lavis_ds.runners.engine import Engine
from lavis_ds.runners.fsdp import FSDPEngine
from lavis_ds.runners.trainer import Trainer

DEFAULT_ENGINE = "runner_deepspeed"  # the engine of a run that names none (run.runner)

__all__ = ["Engine", "Trainer", "DeepSpeedEngine", "FSDPEngine", "DEFAULT_ENGINE"]
