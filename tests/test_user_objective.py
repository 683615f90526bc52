"""The docs' example of a user's objective (tests/user_objective.py, quoted in docs/preference.md): found by name
once its module is imported as `imports:` imports it, its options checked like every run section, its loss the
cDPO formula (DPO's at label_smoothing 0), and it trains a tiny model to prefer the chosen answers."""
from __future__ import annotations

import pytest
import torch

import lavis_ds  # noqa: F401  (fills the registries)
from archs import build_tiny
from conftest import user_module_imported
from lavis_ds.common import registry as reg
from lavis_ds.objectives import Dpo
from lavis_ds.objectives.config import build_objective, objective_problems
from lavis_ds.objectives.reference import REF_CHOSEN, REF_REJECTED, ReferenceScorer


@pytest.fixture(autouse=True, scope="module")
def user_objective_imported():
    """The user's module (its `cdpo` objective), registered for this file's tests only."""
    with user_module_imported("user_objective", reg.objectives):
        yield


def _logps():
    torch.manual_seed(3)
    chosen, rejected, ref_chosen, ref_rejected = (-30 + 5 * torch.rand(4, dtype=torch.float64) for _ in range(4))
    return chosen, rejected, {REF_CHOSEN: ref_chosen, REF_REJECTED: ref_rejected}


def test_the_users_objective_is_built_from_its_run_section():
    objective = build_objective({"task": "cdpo", "cdpo": {"beta": 0.5, "label_smoothing": 0.2}})
    assert (type(objective).__name__, objective.beta, objective.label_smoothing) == ("ConservativeDpo", 0.5, 0.2)
    assert objective_problems({"task": "cdpo", "cdpo": {"label_smothing": 0.2}}) == [
        "run.cdpo.label_smothing: unknown key; did you mean 'label_smoothing'?"]


def test_its_loss_is_cdpo_and_dpo_without_smoothing():
    chosen, rejected, refs = _logps()
    tokens = torch.full((4,), 7)
    mine = build_objective({"task": "cdpo", "cdpo": {"beta": 0.5, "label_smoothing": 0.2}})
    margin = 0.5 * ((chosen - refs[REF_CHOSEN]) - (rejected - refs[REF_REJECTED]))
    expected = -0.8 * torch.nn.functional.logsigmoid(margin) - 0.2 * torch.nn.functional.logsigmoid(-margin)
    torch.testing.assert_close(mine.pair_losses(chosen, rejected, tokens, tokens, refs).losses, expected,
                               rtol=1e-12, atol=1e-12)
    plain = build_objective({"task": "cdpo", "cdpo": {"beta": 0.5, "label_smoothing": 0.0}})
    torch.testing.assert_close(plain.pair_losses(chosen, rejected, tokens, tokens, refs).losses,
                               Dpo(beta=0.5).pair_losses(chosen, rejected, tokens, tokens, refs).losses)


def test_it_trains_a_tiny_model_to_prefer_the_chosen_answers(tiny_tokenizer_dir, tmp_path):
    torch.manual_seed(0)
    model = build_tiny("blip2_qwen", tiny_tokenizer_dir, tmp_path)
    objective = build_objective({"task": "cdpo", "cdpo": {"beta": 0.5, "label_smoothing": 0.1,
                                                          "reference": "precomputed"}})
    objective.setup(model)
    image = "<Img><ImageHere></Img>"
    torch.manual_seed(1)
    side = model.vision_tower.image_size
    pairs = {"image": torch.randn(2, 3, side, side), "num_images": [1, 1],
             "instruction": [[f"{image} What is it?"], [f"{image} What colour is the ball?"]], "output": [[], []],
             "chosen": ["A cat.", "It is red."], "rejected": ["A dog.", "It is blue."], "system": [None, None],
             "index": torch.tensor([0, 1])}
    with torch.no_grad():
        logps = model(ReferenceScorer().prepare(model, pairs))["logps"]
    batch = {**objective.prepare(model, pairs), REF_CHOSEN: logps[:2], REF_REJECTED: logps[2:]}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    margins = []
    for _ in range(6):
        out = model(batch)  # the batch names its objective: the model's forward runs it
        optimizer.zero_grad()
        out["loss_sums"]["pairs"].backward()
        optimizer.step()
        margins.append(float(out["metric_sums"]["rewards/margins"][1]) / 2)
    assert margins[0] == pytest.approx(0.0, abs=1e-6) and margins[-1] > 0.05, margins
    objective.take_metric_sums()
