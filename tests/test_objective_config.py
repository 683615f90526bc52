"""run.task and its options section, checked with the rest of the config; LAVIS's task names keep working."""
from __future__ import annotations

import re

import pytest

from lavis_ds.common.errors import ConfigError
from lavis_ds.common.registry import objectives, registry
from lavis_ds.config import load_config
from lavis_ds.objectives import Dpo, NextTokenSft, Simpo, build_objective, objective_problems
from run_utils import tiny_config, write_yaml


@pytest.fixture
def cfg_path(tmp_path):
    return write_yaml(tmp_path / "run.yaml", tiny_config(tmp_path / "out", tmp_path / "demo"))


def test_dpo_options_are_read_from_the_section_named_after_it():
    run = {"task": "dpo", "dpo": {"beta": 0.2, "loss_type": "ipo"}}
    assert objective_problems(run) == []
    objective = build_objective(run)
    assert isinstance(objective, Dpo) and (objective.beta, objective.loss_type, objective.rpo_alpha) == (0.2, "ipo",
                                                                                                     None)


def test_an_engine_that_does_not_run_objectives_refuses_a_preference_task():
    """Not silently trained as SFT: an engine that says it does not call objectives (``config.RUNS_OBJECTIVES = False``,
    e.g. one that computes its own loss) refuses a pairwise task by name; the built-in engines run them."""
    from lavis_ds.runners.deepspeed import DeepSpeedEngine
    from lavis_ds.runners.fsdp import FSDPEngine

    from lavis_ds.runners.engine import Engine, EngineConfig

    class OwnLossConfig(EngineConfig):
        RUNS_OBJECTIVES = False

    class OwnLossEngine(Engine):
        config = OwnLossConfig

    run = {"task": "dpo", "dpo": {"beta": 0.2}}
    assert objective_problems(run, DeepSpeedEngine) == objective_problems(run, FSDPEngine) == []
    assert objective_problems(run, OwnLossEngine) == [
        "run.task: 'dpo' trains on preference pairs, which the engine OwnLossEngine does not run (it trains the "
        "model's next-token loss); use an engine that calls objectives (config.RUNS_OBJECTIVES)"]


def test_default_and_lavis_task_names_are_sft(cfg_path):
    assert isinstance(build_objective(load_config(cfg_path, check_files=False).run), NextTokenSft)
    for task in ("image_text_pretrain", "deepspeed_image_text_pretrain", "captioning", "vqa"):
        assert isinstance(build_objective({"task": task}), NextTokenSft), task


def test_every_problem_of_the_objective_is_reported_with_the_rest(cfg_path):
    with pytest.raises(ConfigError) as info:
        load_config(cfg_path, ["run.task=dpo", "run.dpo.bta=0.2", "run.dpo.loss_type=kto", "run.simpo.beta=2",
                               "run.max_epoch=0"], check_files=False)
    problems = info.value.problems
    assert "run.dpo.bta: unknown key; did you mean 'beta'?" in problems
    assert "run.dpo.loss_type: expected 'sigmoid' | 'ipo' | 'hinge', got 'kto'" in problems
    assert ("run.simpo: options of the objective 'simpo', but run.task is 'dpo'; move them to run.dpo or remove "
            "them") in problems
    assert any(p.startswith("run.max_epoch") for p in problems)  # the others still reported, all at once


@pytest.mark.parametrize("run, message", [
    ({"task": "dpoo"}, r"run.task: Unknown objective 'dpoo'. Did you mean 'dpo'\?"),
    ({"task": "retrieval"}, r"run.task: 'retrieval' is LAVIS's image-text retrieval .* which lavis_ds does not "
                            r"train; its objectives: dpo, orpo, sft, simpo"),
    ({"task": "simpo", "simpo": {"gamma": 1.0, "simpo_gamma": 2.0}},
     r"run.simpo: gamma=1.0 and simpo_gamma=2.0 are one setting in two spellings; give one"),
    ({"task": "dpo", "dpo": {"beta": 0}}, r"run.dpo.beta: 0 is out of range; valid: > 0"),
    ({"task": "dpo", "dpo": "fast"}, r"run.dpo: expected a mapping of dpo's options, got 'fast'"),
])
def test_bad_objective_settings_are_named(run, message):
    problems = objective_problems(run)
    assert len(problems) == 1 and __import__("re").search(message, problems[0]), problems


def test_simpo_takes_trl_and_llamafactory_spelling_of_gamma():
    assert build_objective({"task": "simpo", "simpo": {"simpo_gamma": 0.8}}).gamma == 0.8
    assert Simpo().gamma == 0.5


def test_lavis_style_registration_of_a_users_objective():
    @registry.register_task("my_test_objective")
    class Mine(NextTokenSft):
        def __init__(self, weight: float = 1.0):
            self.weight = weight

    try:
        assert registry.get_task_class("my_test_objective") is Mine
        assert build_objective({"task": "my_test_objective", "my_test_objective": {"weight": 2.0}}).weight == 2.0
        assert objective_problems({"task": "my_test_objective", "my_test_objective": {"wieght": 2}}) == [
            "run.my_test_objective.wieght: unknown key; did you mean 'weight'?"]
    finally:
        objectives._entries.pop("my_test_objective")


def test_the_objective_and_the_training_data_must_agree_on_pairs(tmp_path):
    cfg = tiny_config(tmp_path / "out", tmp_path / "demo")
    cfg["datasets"]["prefs"] = {"builder": "preference_pairs", "pair_format": "swift",
                                "build_info": {"annotations": {"train": {"storage": "pairs.jsonl"}},
                                               "images": {"storage": str(tmp_path)}},
                                "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 64},
                                                  "eval": {"name": "blip2_image_eval", "image_size": 64}}}
    path = write_yaml(tmp_path / "run.yaml", cfg)
    with pytest.raises(ConfigError) as info:
        load_config(path, check_files=False)
    assert info.value.problems == ["datasets.prefs: makes pairs but run.task 'sft' trains on sequences "
                                   "(instruction samples)"]
    with pytest.raises(ConfigError) as info:
        load_config(path, ["run.task=simpo"], check_files=False)
    assert "datasets.demo_shapes: makes sequences but run.task 'simpo' trains on pairs (a preference_pairs " \
           "section)" in info.value.problems


@pytest.mark.parametrize("option, message", [
    ({"packing": True}, r"run.packing: packs samples end to end, which run.task 'dpo' does not do"),
    ({"batch_unit": "tokens"}, r"run.batch_unit: fills micro-batches to a token budget, which run.task 'dpo' does not"),
])
def test_pairs_are_not_packed_nor_filled_to_a_token_budget(option, message):
    problems = objective_problems({"task": "dpo", **option})
    assert len(problems) == 1 and re.match(message, problems[0]), problems
