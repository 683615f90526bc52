"""The objective's config: ``run.task`` names it, the run section named after it holds its options.

    run:
      task: dpo                # LAVIS's key; unset: sft. LAVIS's task names (image_text_pretrain, ...) mean sft
      dpo: {beta: 0.1, loss_type: sigmoid, rpo_alpha: null}

One section per objective, named after its registered name (an alias's options go under the registered
name: ``task: image_text_pretrain`` reads ``run.sft``). The section's keys are the objective's constructor
arguments, checked like every other component's.
"""
from __future__ import annotations

from typing import Any, Mapping

from lavis_ds.common.registry import objectives
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.objectives.base import Objective
from lavis_ds.objectives.sft import NOT_NEXT_TOKEN_TASKS

DEFAULT_OBJECTIVE = "sft"


def options_key(task: str) -> str:
    """The run key of an objective's options: its registered name (an alias's target)."""
    return objectives.canonical(task)


def option_section_keys() -> set[str]:
    """Every run key an objective's options may sit under (the config checker accepts them as run keys)."""
    return set(objectives)


def objective_problems(run: Mapping[str, Any], engine_class: type | None = None) -> list[str]:
    """What is wrong with ``run.task`` and its options section, each naming its key path; [] if it builds.
    ``engine_class``: the run's engine class, which must say it calls objectives (``config.RUNS_OBJECTIVES``) to
    train one other than the model's own next-token loss."""
    task = run.get("task") or DEFAULT_OBJECTIVE
    if not isinstance(task, str):
        return [f"run.task: expected an objective's name, got {task!r}; known: {', '.join(objectives)}"]
    if task in NOT_NEXT_TOKEN_TASKS:
        return [f"run.task: {task!r} is {NOT_NEXT_TOKEN_TASKS[task]}, which lavis_ds does not train; its objectives: "
                f"{', '.join(objectives)} (LAVIS's captioning/vqa/image_text_pretrain tasks mean sft)"]
    if task not in objectives:
        try:
            objectives.get(task)
        except KeyError as e:
            return [f"run.task: {e.args[0]}"]
    key = options_key(task)
    problems = [f"run.{other}: options of the objective {other!r}, but run.task is {task!r}; move them to run.{key} "
                f"or remove them" for other in sorted(option_section_keys() - {key})
                if isinstance(run.get(other), Mapping) and run[other]]
    section = run.get(key)
    if section is None:
        return problems + pairwise_run_problems(run, objectives.get(task))
    if not isinstance(section, Mapping):
        return problems + [f"run.{key}: expected a mapping of {key}'s options, got {section!r}"]
    cls = objectives.get(task)
    if engine_class is not None and cls.DATA != "sequences" and not engine_class.config.RUNS_OBJECTIVES:
        engine_name = getattr(engine_class, "__name__", engine_class)
        problems.append(f"run.task: {task!r} trains on preference pairs, which the engine {engine_name} does not run "
                        f"(it trains the model's next-token loss); use an engine that calls objectives "
                        f"(config.RUNS_OBJECTIVES)")
    problems += pairwise_run_problems(run, cls)
    before = len(problems)
    check_section(dict(section), fields_of(cls), f"run.{key}", problems)
    if len(problems) == before:
        try:
            cls.from_config(section)
        except ValueError as e:
            problems.append(f"run.{key}: {e}")
    return problems


def pairwise_run_problems(run: Mapping[str, Any], cls: type) -> list[str]:
    """Run settings a pairwise objective does not take: its two sides are scored padded, side by side."""
    if cls.DATA != "pairs":
        return []
    return [f"run.{key}: {what}, which run.task {run.get('task')!r} does not do (its pairs are padded, both sides in "
            f"one forward); remove it" for key, value, what in (
                ("packing", run.get("packing"), "packs samples end to end"),
                ("batch_unit", run.get("batch_unit") == "tokens", "fills micro-batches to a token budget"))
            if value]


def build_objective(run: Mapping[str, Any]) -> Objective:
    """The objective a checked ``run`` section names, built from its options section."""
    task = run.get("task") or DEFAULT_OBJECTIVE
    return objectives.get(task).from_config(run.get(options_key(task)) or {})


def data_problems(run: Mapping[str, Any], training_builders: Mapping[str, type]) -> list[str]:
    """Training datasets whose samples the objective cannot train on: pairs for a next-token objective, or
    instruction samples for a pairwise one. ``training_builders``: ``{section name: builder class}`` of the
    sections that train; a builder says what it makes in ``SAMPLES`` ("sequences" unless it says "pairs")."""
    task = run.get("task") or DEFAULT_OBJECTIVE
    if not isinstance(task, str) or task not in objectives:
        return []  # reported by objective_problems
    wanted = objectives.get(task).DATA
    return [f"datasets.{name}: makes {getattr(cls, 'SAMPLES', 'sequences')} but run.task {task!r} trains on "
            f"{wanted}" + (" (a preference_pairs section)" if wanted == "pairs" else " (instruction samples)")
            for name, cls in training_builders.items() if getattr(cls, "SAMPLES", "sequences") != wanted]
