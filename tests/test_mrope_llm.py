"""Qwen2-VL's text model in the LLM slot: logits equal transformers' on text, M-RoPE positions reach it padded
([3, B, L]) and packed ([4, B, L]), packed equals padded, and generation continues each sample at its rope delta."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from archs import loss_and_grads
from lavis_ds.models import Blip2Qwen
from lavis_ds.models.llm_families import llm_config_problems
from lavis_ds.models.image_layout import ImageLayout
from lavis_ds.models.image_path import ImagePath
from lavis_ds.models.positions import TextPositions, Visual
from lavis_ds.models.qwen_vl_text import Qwen2VLTextForCausalLM

TEXT = {"model_type": "qwen2_vl_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "initializer_range": 0.1, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
QUESTIONS = ["What is in the image?", "What colour is the ball, and how large is it?", "Count them.",
             "Describe the picture."]
ANSWERS = ["A cat.", "It is red and small.", "Three.", "A dog runs on the grass next to a red ball."]


class GridQueryLayout(ImageLayout):
    """The Q-Former's 8 queries laid out as a 2 x 4 grid of LLM tokens (as a Qwen-VL tower's are on its grid)."""

    def visuals(self, samples):
        return [Visual(n, (1, 2, n // 2)) for n in self.counts(samples)]


class GridQueryPath(ImagePath):
    LAYOUT = GridQueryLayout


class GridQueries(Blip2Qwen):
    """An image path that says its grid through the documented hook (its ``IMAGE_PATH``'s layout), so that images
    take M-RoPE's grid positions."""

    IMAGE_PATH = GridQueryPath


@pytest.fixture(scope="module")
def model(tiny_tokenizer_dir) -> GridQueries:
    cfg = {**Blip2Qwen.default_config("tiny"), "tokenizer": str(tiny_tokenizer_dir), "llm_config": TEXT}
    torch.manual_seed(0)
    return GridQueries.from_config(cfg).eval()


def _batch(size: int = 64) -> dict:
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    return {"image": images, "num_images": [1, 0, 2, 0],
            "instruction": [[f"<Img><ImageHere></Img> {QUESTIONS[0]}"], [QUESTIONS[1]],
                            [f"<ImageHere> and <ImageHere>: {QUESTIONS[2]}"], [QUESTIONS[3]]],
            "output": [[a] for a in ANSWERS]}


def test_the_text_model_gives_transformers_logits_on_text(model):
    """Our Qwen2VLTextForCausalLM with the weights of a Qwen2VLForConditionalGeneration gives its logits on text."""
    llm = model.llm_model
    assert isinstance(llm, Qwen2VLTextForCausalLM) and model.llm.positions.rows == 3
    config = Qwen2VLConfig(text_config=llm.config.to_dict(), vision_config={
        "depth": 1, "embed_dim": 16, "hidden_size": 64, "num_heads": 2})
    torch.manual_seed(1)
    theirs = Qwen2VLForConditionalGeneration(config).eval()
    theirs.model.language_model.load_state_dict(llm.model.state_dict())
    theirs.lm_head.load_state_dict(llm.lm_head.state_dict())
    ids = model.prepare_batch({"instruction": [[q] for q in QUESTIONS[:2]], "output": [[a] for a in ANSWERS[:2]],
                               "num_images": [0, 0]})
    with torch.no_grad():
        expected = theirs(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        ours = llm(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                   position_ids=ids["rope_position_ids"]).logits
    filled = ids["attention_mask"].bool()  # padding positions are numbered differently and never read
    assert filled.sum() < filled.numel()
    torch.testing.assert_close(ours[filled], expected[filled], atol=1e-5, rtol=0)


def test_packed_equals_padded_with_mrope_positions_reaching_the_llm(model):
    seen = []
    hook = model.llm_model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].shape), with_kwargs=True)
    try:
        padded, loss_a, grads_a = loss_and_grads(model, _batch(), None)
        packed, loss_b, grads_b = loss_and_grads(model, _batch(), 256)
    finally:
        hook.remove()
    assert seen == [(3, *padded["input_ids"].shape), (4, *packed["input_ids"].shape)]
    assert packed["input_ids"].shape[0] < 4  # samples share rows
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    whole = torch.cat([g.flatten() for g in grads_a.values()])
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-7 * whole.norm(), name
    # The positions matter: the same batch numbered 1-D gives another loss.
    positions, model.llm.positions = model.llm.positions, TextPositions()
    try:
        with torch.no_grad():
            plain = model(model.prepare_batch(_batch()))["loss_sum"]
    finally:
        model.llm.positions = positions
    assert not torch.allclose(plain, loss_a, atol=1e-4)


def test_generation_continues_each_sample_at_its_rope_delta(model):
    """The prompt takes its M-RoPE ids; every new token the plain position plus its sample's rope delta, as
    transformers' Qwen2-VL computes from its cached rope_deltas."""
    batch = {"image": _batch()["image"][:1], "num_images": [1, 0],
             "instruction": [[f"<Img><ImageHere></Img> {QUESTIONS[0]}"], [QUESTIONS[1]]]}
    steps = []
    hook = model.llm_model.model.register_forward_pre_hook(
        lambda module, args, kwargs: steps.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        model.generate(batch, max_new_tokens=3, min_new_tokens=3)
    finally:
        hook.remove()
    prompts = [model.llm.prompt.generation_prompt(batch["instruction"][0], (), 1, [8]),
               model.llm.prompt.generation_prompt(batch["instruction"][1], (), 0, [])]
    own = [model.llm.positions.positions(p, [model.llm.prompt.image_token_id], v)
           for p, v in zip(prompts, ([Visual(8, (1, 2, 4))], []))]
    deltas = [model.llm.positions.rope_delta(o) for o in own]
    assert deltas[0] < 0 == deltas[1]  # the image's 8 tokens take 4 positions (2 x 4 grid): delta -4
    first = steps[0]
    assert first.shape[:2] == (3, 2)
    for row, ids in enumerate(own):
        assert torch.equal(first[:, row, -ids.shape[1]:], ids)
    for step, positions in enumerate(steps[1:], start=1):
        plain = torch.tensor([len(p) - 1 + step for p in prompts])
        assert torch.equal(positions[:, :, -1], (plain + torch.tensor(deltas)).expand(3, -1)), step


def test_an_mrope_section_that_does_not_fit_the_head_is_refused():
    problems = llm_config_problems({**TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 4, 4]}})
    assert problems == ["model.llm_config.rope_parameters.mrope_section: [4, 4, 4] adds up to 12, but M-RoPE splits "
                        "half the rotary dimensions of each head (16 // 2 = 8) into its temporal, height and width "
                        "parts; give three numbers that add up to it"]
    assert llm_config_problems(TEXT) == []
