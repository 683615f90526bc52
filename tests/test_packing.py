"""Padding-free packing (run.packing): rows of whole samples, each sample attending only to itself."""
from __future__ import annotations

import pytest
import torch

from lavis_ds.models import Blip2Qwen
from lavis_ds.models.packing import pack, plan_rows

QUESTIONS = ["What is in the image?", "Describe the picture in detail.", "What color is the ball?",
             "How many animals are there?", "What is in the image?", "Describe the picture in detail."]
ANSWERS = ["A cat.", "A dog runs on the grass next to a red ball. " * 3, "It is red.", "Two.",
           "A cat sitting on a mat.", "Red."]


def test_the_plan_takes_first_fit_in_order_or_longest_first_whichever_needs_fewer_rows():
    lengths = [5, 9, 3, 7, 2, 4]
    rows = plan_rows(lengths, 10)
    assert rows == [[0, 2, 4], [1], [3], [5]]  # four rows either way: in order
    assert plan_rows(lengths, 10) == rows  # a function of the samples only: a resumed step packs alike
    # in order 3 rows of 6 (3+2, 4, 3), longest first 2 (4+2, 3+3): longest first
    assert plan_rows([3, 2, 4, 3], 6) == [[2, 1], [0, 3]]
    # a micro-batch planned in order by a token budget (datasets.samplers.fill_rows) keeps its 2 rows of 256,
    # where longest first would need 3
    lengths = [52, 57, 57, 75, 57, 57, 75, 57]
    assert len(plan_rows(lengths, 256)) == 2 and len(plan_rows(sorted(lengths, reverse=True), 256)) == 3
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens, more than a packed row's 8 \(run.max_seq_len\)"):
        plan_rows([5, 9, 3], 8)


def test_positions_restart_per_sample_and_the_tail_is_unsupervised():
    examples = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [-100, 5]), ([6, 7, 8, 9], [-100, -100, 8, 9])]
    packed = pack(examples, max_len=6, pad_id=0, ignore_index=-100)
    assert packed["order"] == [0, 1, 2]
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]  # as wide as the longest row
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert packed["labels"].tolist() == [[-100, 2, 3, -100, 5], [-100, -100, 8, 9, -100]]
    assert packed["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    reordered = pack([*examples, ([10, 11, 12], [-100, 11, 12])], max_len=6, pad_id=0, ignore_index=-100)
    assert reordered["order"] == [2, 1, 0, 3]  # longest first: 2 rows (4+2, 3+3) where in order takes 3
    assert reordered["input_ids"].tolist() == [[6, 7, 8, 9, 4, 5], [1, 2, 3, 10, 11, 12]]


def _batch(model_cfg) -> dict:
    torch.manual_seed(0)
    n = len(QUESTIONS)
    return {"image": torch.randn(n, 3, model_cfg["image_size"], model_cfg["image_size"]),
            "instruction": [[f"<Img><ImageHere></Img> {q}"] for q in QUESTIONS], "output": [[a] for a in ANSWERS]}


def test_a_packed_batch_has_the_loss_and_gradients_of_the_same_samples_unpacked(tiny_model_config):
    torch.manual_seed(0)
    model = Blip2Qwen.from_config({**tiny_model_config, "freeze_llm": False}).eval()  # eval: no dropout
    batch = _batch(tiny_model_config)
    results = {}
    for name, pack_to in (("padded", None), ("packed", 192)):  # 6 samples in 3 rows
        model.zero_grad(set_to_none=True)
        prepared = model.prepare_batch(dict(batch), pack_to=pack_to)
        out = model(prepared)
        out["loss_sum"].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (prepared, out, grads)
    (padded, out_a, grads_a), (packed, out_b, grads_b) = results["padded"], results["packed"]
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]  # several samples share a row
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # fewer positions: the padding is gone
    assert int(out_a["num_tokens"]) == int(out_b["num_tokens"]) == model.supervised_tokens(packed)
    assert torch.allclose(out_b["loss_sum"], out_a["loss_sum"], rtol=1e-5, atol=0)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    # Relative to the norms (sums over samples run in another order); a gradient that is zero in exact arithmetic
    # (the Q-Former's key bias: softmax ignores it) is rounding noise on both sides, measured against the whole.
    whole = torch.cat([g.flatten() for g in grads_a.values()])
    assert (torch.cat([grads_b[n].flatten() for n in grads_a]) - whole).norm() <= 1e-5 * whole.norm()
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-7 * whole.norm(), name


def test_without_positions_the_samples_of_a_row_would_see_each_other(tiny_model_config):
    """The check above can fail: the same packed rows with one position sequence per row (one long sample)."""
    torch.manual_seed(0)
    model = Blip2Qwen.from_config(tiny_model_config).eval()
    batch = _batch(tiny_model_config)
    padded = model(model.prepare_batch(dict(batch)))
    packed = model.prepare_batch(dict(batch), pack_to=192)
    packed["position_ids"] = torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"]).clone()
    leaked = model(packed)
    assert not torch.allclose(leaked["loss_sum"], padded["loss_sum"], rtol=1e-3)


def test_a_packed_run_takes_the_steps_of_the_padded_run_through_train_py(tmp_path):
    """Same samples, same steps: the length-grouped run's curve is the padded run's, and the packed run's (a token
    budget, run.packing's default) the curve of the same token budget padded, within 1e-5 (fp32, dropout off,
    run.loss_reduction: tokens); config.yaml says what the budget resolved to; and a packed run SIGKILLed anywhere
    continues bit for bit."""
    import forked
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
    from omegaconf import OmegaConf
    from run_utils import REPO, env, killed_run_continues_bit_for_bit, tiny_config, train_args, train_steps, write_yaml

    storage = ensure_demo_shapes(tmp_path / "demo_shapes", DemoShapesSpec(num_train=64, num_val=16, num_test=8))
    tokens = {"batch_unit": "tokens", "max_seq_len": 256}
    jobs = {}
    for name, micro, run in (("padded", 8, {}), ("grouped", 8, {"length_grouped": True}),
                             ("padded_tokens", 2, tokens), ("packed", 2, {"packing": True, "max_seq_len": 256})):
        cfg = tiny_config(tmp_path / name, storage, micro=micro, **run)
        cfg["model"].update(qformer={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
        jobs[name] = forked.Job(train_args(write_yaml(tmp_path / f"{name}.yaml", cfg)), 0, env(), REPO,
                                tmp_path / f"{name}_logs")
    for name, job in jobs.items():
        assert job.wait(300) == 0, job.output()[1][-3000:]
    resolved = OmegaConf.load(tmp_path / "packed" / "config.yaml").run
    assert (resolved.batch_unit, resolved.global_batch_size, resolved.global_batch_tokens) == ("tokens", 2, 512)
    assert len(train_steps(tmp_path / "padded")) == 8 and len(train_steps(tmp_path / "packed")) >= 6
    for mine, theirs in [pair for name, reference in (("grouped", "padded"), ("packed", "padded_tokens"))
                         for pair in zip(train_steps(tmp_path / name), train_steps(tmp_path / reference), strict=True)]:
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"], (mine, theirs)
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= 1e-5 * theirs["grad_norm"], (mine, theirs)
    # A step holds about 512 tokens' worth of samples (the demo's are about 60 tokens), padded only to the row.
    packed = train_steps(tmp_path / "packed")
    assert max(m["padding_share"] for m in packed) < 0.2
    (tmp_path / "kill").mkdir()
    killed_run_continues_bit_for_bit(tmp_path / "kill", storage, stage=2, dtype="fp32", packing=True,
                                     max_seq_len=256, micro=1, accum=1, steps_per_epoch=8)


def test_packing_keeps_each_samples_images_with_it_for_none_one_or_several(tiny_model_config):
    """Text-only, one-image and two-image samples in one micro-batch: packed, every image still lands in its own
    sample's placeholders (the loss of each sample is unchanged, so the sums agree)."""
    torch.manual_seed(0)
    model = Blip2Qwen.from_config(tiny_model_config).eval()
    counts = [0, 1, 2, 1, 0, 2]
    instructions = [("" if n == 0 else "<Img>" + "<ImageHere>" * n + "</Img> ") + q for n, q in zip(counts, QUESTIONS)]
    size = tiny_model_config["image_size"]
    batch = {"image": torch.randn(sum(counts), 3, size, size), "num_images": counts,
             "instruction": [[i] for i in instructions], "output": [[a] for a in ANSWERS]}
    padded = model(model.prepare_batch(dict(batch)))
    packed_batch = model.prepare_batch(dict(batch), pack_to=100)  # 40 + 55 share a row: samples 0, 3, 1, 2, 4, 5
    assert packed_batch["order"] != list(range(6))  # reordered: the images must follow their samples
    packed = model(packed_batch)
    assert torch.allclose(packed["loss_sum"], padded["loss_sum"], rtol=1e-5, atol=0)
    swapped = dict(batch, image=batch["image"].flip(0))  # the same images, each in another sample's place
    assert not torch.allclose(model(model.prepare_batch(swapped, pack_to=100))["loss_sum"], padded["loss_sum"],
                              rtol=1e-4)
