"""Training objectives, a registry kind (``run.task``; importing this registers the built-in ones).

``sft`` (default, and LAVIS's task names), ``dpo`` (sigmoid / ipo / hinge, optional ``rpo_alpha``),
``simpo`` and ``orpo``. See ``base`` for how a loss is normalised and ``config`` for the run section.
"""
from lavis_ds.objectives.base import PAIRS, TOKENS, Objective, ObjectiveOutput, global_loss, micro_batch_weights
from lavis_ds.objectives.config import DEFAULT_OBJECTIVE, build_objective, objective_problems, options_key
from lavis_ds.objectives.preference import Dpo, Orpo, PreferenceObjective, Simpo
from lavis_ds.objectives.sft import NextTokenSft

__all__ = ["Objective", "ObjectiveOutput", "PAIRS", "TOKENS", "global_loss", "micro_batch_weights",
           "DEFAULT_OBJECTIVE", "build_objective", "objective_problems", "options_key",
           "NextTokenSft", "PreferenceObjective", "Dpo", "Simpo", "Orpo"]
