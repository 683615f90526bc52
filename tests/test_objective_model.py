"""The preference objectives on a tiny real BLIP2-Qwen: one vision pass per pair, both sides in one forward, and
answer log-probs that equal the model's own SFT loss on the same answers."""
from __future__ import annotations

import pytest
import torch

from lavis_ds.common.errors import LavisDsError
from lavis_ds.models import Blip2Qwen
from lavis_ds.objectives import PAIRS, TOKENS, Dpo, Orpo, Simpo, model_calls
from lavis_ds.objectives.model_calls import IGNORE_INDEX, last_answer_labels

IMG = "<Img><ImageHere></Img>"


@pytest.fixture
def model(tiny_model_config):
    torch.manual_seed(0)
    return Blip2Qwen.from_config(tiny_model_config).eval()  # eval: no dropout, so separate passes agree


@pytest.fixture
def pairs():
    torch.manual_seed(1)
    return {"image": torch.randn(2, 3, 64, 64), "num_images": [1, 1],
            "instruction": [[f"{IMG} What is in the image?"], [f"{IMG} Describe the picture in detail.",
                                                                  "What color is the ball?"]],
            "output": [[], ["A dog runs on the grass next to a red ball."]],
            "chosen": ["A cat sitting on a mat.", "It is red."], "rejected": ["A dog runs on the grass.", "Two."],
            "system": [None, None], "index": torch.tensor([0, 1])}


def _sft_loss_sum(model, image, instructions, outputs, system=None):
    batch = {"image": image, "num_images": [1], "instruction": [instructions], "output": [outputs], "system": [system]}
    out = model(batch)
    return float(out["loss_sum"]), int(out["num_tokens"])


@torch.no_grad()
def test_answer_logps_equal_the_sft_loss_of_the_last_answer(model, pairs):
    batch = model_calls.prepare_pairs(model, pairs)
    logps, tokens = model_calls.answer_logps(model, batch, model_calls.image_features(model, batch))
    # pair 0, one turn: the chosen side's log-prob is minus the SFT loss of that conversation
    loss, count = _sft_loss_sum(model, pairs["image"][:1], pairs["instruction"][0], [pairs["chosen"][0]])
    assert float(logps[0]) == pytest.approx(-loss, rel=1e-5) and int(tokens[0]) == count
    loss, count = _sft_loss_sum(model, pairs["image"][:1], pairs["instruction"][0], [pairs["rejected"][0]])
    assert float(logps[2]) == pytest.approx(-loss, rel=1e-5) and int(tokens[2]) == count
    # pair 1, two turns: only the last answer is scored; the earlier answer is prompt (the SFT loss of the first
    # turn alone has the same prefix, so the difference is the last answer's)
    full, full_count = _sft_loss_sum(model, pairs["image"][1:], pairs["instruction"][1],
                                     [pairs["output"][1][0], pairs["chosen"][1]])
    first, first_count = _sft_loss_sum(model, pairs["image"][1:], pairs["instruction"][1][:1], pairs["output"][1])
    assert float(logps[1]) == pytest.approx(-(full - first), rel=1e-4)
    assert int(tokens[1]) == full_count - first_count


def test_one_vision_pass_per_pair_and_one_llm_forward(model, pairs):
    calls = []
    model.vision_tower.vit.register_forward_hook(lambda module, args, out: calls.append(("vit", args[0].shape[0])))
    # the LLM's token embedding runs once per LLM forward (whichever head computes the log-probs)
    model.llm_model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: calls.append(("llm", args[0].shape[0])))
    ref = {"ref_chosen_logps": torch.zeros(2), "ref_rejected_logps": torch.zeros(2)}
    Dpo(beta=0.1)(model, {**pairs, **ref})
    assert calls == [("vit", 2), ("llm", 4)]  # 2 pairs: their 2 images once, then 2 x 2 sides in one forward


@pytest.mark.parametrize("objective", [Dpo(beta=0.1, rpo_alpha=1.0), Simpo(beta=2.0), Orpo(beta=0.1)],
                         ids=["dpo+rpo", "simpo", "orpo"])
def test_objective_trains_the_bridge_and_logs_trl_metrics(model, pairs, objective):
    model.train()
    batch = objective.prepare(model, {**pairs, "ref_chosen_logps": torch.tensor([-30.0, -5.0]),
                                      "ref_rejected_logps": torch.tensor([-25.0, -4.0])})
    counts = objective.counts(model, batch)
    out = objective(model, batch)
    assert counts[PAIRS] == 2
    loss = sum(out.loss_sums[unit] / counts[unit] for unit in out.loss_sums)
    loss.backward()
    assert model.connector.llm_proj.weight.grad.abs().sum() > 0 and model.connector.query_tokens.grad.abs().sum() > 0
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected"} <= set(out.metric_sums)
    if objective.sft_weight():  # the SFT term's unit: the chosen answers' supervised tokens
        chosen_labels = batch["labels"][:2, 1:]
        assert counts[TOKENS] == int((chosen_labels != IGNORE_INDEX).sum()) > 0


def test_dpo_without_reference_logps_says_what_is_missing(model, pairs):
    with pytest.raises(LavisDsError, match=r"run.task: dpo needs the reference model's log-probs of each pair "
                                           r"\(ref_chosen_logps, ref_rejected_logps missing"):
        Dpo()(model, pairs)


@torch.no_grad()
def test_a_pair_is_scored_with_its_own_system_prompt_as_sft_trains_it(model, pairs):
    own = {**pairs, "system": ["Be terse.", None]}
    batch = model_calls.prepare_pairs(model, own)
    logps, _ = model_calls.answer_logps(model, batch, model_calls.image_features(model, batch))
    loss, _ = _sft_loss_sum(model, pairs["image"][:1], pairs["instruction"][0], [pairs["chosen"][0]], "Be terse.")
    default, _ = _sft_loss_sum(model, pairs["image"][:1], pairs["instruction"][0], [pairs["chosen"][0]])
    assert float(logps[0]) == pytest.approx(-loss, rel=1e-5) and loss != pytest.approx(default, rel=1e-5)
    text = model.llm.tokenizer.decode(batch["input_ids"][0])
    assert "<|im_start|>system\nBe terse.<|im_end|>" in text and "helpful assistant" not in text
    assert "helpful assistant" in model.llm.tokenizer.decode(batch["input_ids"][1])  # pair 1 has none of its own


def test_last_answer_labels_keep_only_the_last_answer_and_name_a_cut_one():
    X = IGNORE_INDEX
    labels = torch.tensor([[X, 5, 6, X, X, 7, 8, X], [X, X, 9, 9, X, X, X, X]])
    kept = last_answer_labels(labels, turns=[2, 1])
    assert kept.tolist() == [[X, X, X, X, X, 7, 8, X], [X, X, 9, 9, X, X, X, X]]
    with pytest.raises(LavisDsError, match=r"pair 7 \(chosen\): the last answer does not fit in model.max_txt_len"):
        last_answer_labels(labels, turns=[2, 2], where=["pair 3 (chosen)", "pair 7 (chosen)"])
