"""Qwen3.5's hybrid text model (Gated-DeltaNet + attention) in the LLM slot: packed equals padded because each
sample's recurrent state and causal convolution restart (and differ when the boundaries are dropped), LoRA reaches
the linear-attention projections, an LLM whose recurrent layers take no boundaries is refused under packing, a
Qwen3.5 vision-language folder is named, and the FLOP model counts the linear-attention layers.

The kernels (flash-linear-attention, causal-conv1d) are not installed here: the per-span torch path runs."""
from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

from archs import loss_and_grads
from families import FAMILIES, tokenizer_dir
from lavis_ds.common.errors import InputError
from lavis_ds.models import Blip2Qwen, vision_llm
from lavis_ds.models.flops import ZERO, compose
from lavis_ds.models.linear_attention import (PackedGatedDeltaNet, PackedSamples, Qwen3_5TextForCausalLM,
                                              kernels_take_boundaries)
from lavis_ds.models.llm import Recipe
from lavis_ds.models.llm_families import llm_config_problems
from lavis_ds.models.linear_attention import model_packing_problems as packing_problems

LAYERS = ["linear_attention", "full_attention"]
TEXT = {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "initializer_range": 0.1,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "layer_types": LAYERS}
QUESTIONS = ["What is in the image?", "What colour is the ball, and how large is it?", "Count them.",
             "Describe the picture."]
# The last answer is long enough (> 64 tokens) for the delta rule to carry its state from one chunk to the next.
ANSWERS = ["A cat.", "It is red and small.", "Three.", "A dog runs on the grass next to a red ball. " * 6]


def _batch() -> dict:
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return {"image": images, "num_images": [1, 0, 2, 0],
            "instruction": [[f"<Img><ImageHere></Img> {QUESTIONS[0]}"], [QUESTIONS[1]],
                            [f"<ImageHere> and <ImageHere>: {QUESTIONS[2]}"], [QUESTIONS[3]]],
            "output": [[a] for a in ANSWERS]}


def _build(tokenizer, **overrides) -> Blip2Qwen:
    cfg = {**Blip2Qwen.default_config("tiny"), "tokenizer": str(tokenizer), "llm_config": TEXT,
           **FAMILIES["qwen3.5"].model, **overrides}
    torch.manual_seed(0)
    return Blip2Qwen.from_config(cfg)


@pytest.fixture(scope="module")
def qwen3_5_tokenizer(tmp_path_factory):
    """A tiny tokenizer with Qwen3.5's special tokens and its published chat template (tests/families.py)."""
    return tokenizer_dir(tmp_path_factory.mktemp("qwen3_5_tokenizer"), "qwen3.5")


@pytest.fixture(scope="module")
def model(qwen3_5_tokenizer) -> Blip2Qwen:
    return _build(qwen3_5_tokenizer).eval()


def test_packed_equals_padded_and_dropping_the_boundaries_leaks_the_state(model, monkeypatch):
    llm = model.llm_model
    assert isinstance(llm, Qwen3_5TextForCausalLM) and not kernels_take_boundaries()
    assert type(llm.model.layers[0].linear_attn) is PackedGatedDeltaNet
    # ZeRO-3 gathers a module's parameters at each of its calls (a parameter read without one is an empty partition
    # below stage3_param_persistence_threshold): padded and packed, every module with parameters is called, once.
    calls = Counter()
    hooks = [module.register_forward_pre_hook(lambda module, args: calls.update([module]))
             for layer in llm.model.layers if hasattr(layer, "linear_attn") for module in layer.linear_attn.modules()
             if next(module.parameters(recurse=False), None) is not None]
    try:
        padded, loss_a, grads_a = loss_and_grads(model, _batch(), None)
        padded_calls, calls = calls, Counter()
        packed, loss_b, grads_b = loss_and_grads(model, _batch(), 512)
    finally:
        for hook in hooks:
            hook.remove()
    # Qwen3.5's template, thinking off: each answer follows an empty think block, as generation would see it
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nA cat.<|im_end|>" in \
        model.llm.tokenizer.decode(padded["input_ids"][0])
    assert padded["input_ids"].shape[0] == 4  # four padded rows
    assert packed["input_ids"].shape[0] == 1 and len(packed["row_spans"][0]) == 4  # four samples in one row
    for counted in (padded_calls, calls):
        assert len(counted) == len(hooks) and set(counted.values()) == {1}
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    whole = torch.cat([g.flatten() for g in grads_a.values()])
    assert grads_a.keys() == grads_b.keys() and any("linear_attn.conv1d" in name for name in grads_a)
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-7 * whole.norm(), name
    # The same packed row with no boundaries beside the positions: attention still keeps samples apart, but the
    # Gated-DeltaNet state and convolution carry each sample into the next.
    monkeypatch.setattr(vision_llm, "boundary_kwargs", lambda *args: {})
    with torch.no_grad():
        leaked = model(model.prepare_batch(_batch(), pack_to=512))["loss_sum"]
    assert not torch.allclose(leaked, loss_a, atol=1e-3)


def test_generation_reads_the_convolution_weight_inside_a_call_of_the_convolution(model):
    """transformers' cached path passes ``conv1d.weight`` to its functions: lavis_ds runs it inside a call of conv1d
    (where ZeRO-3 holds the weight gathered) at every forward of ``generate``; the tokens are transformers'
    (tests/test_qwen3_5.py)."""
    llm = model.llm_model
    convs = [layer.linear_attn.conv1d for layer in llm.model.layers if hasattr(layer, "linear_attn")]
    calls = Counter()
    hooks = [conv.register_forward_pre_hook(lambda module, args: calls.update([module])) for conv in convs]
    try:
        with torch.no_grad():
            out = llm.generate(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=3, min_new_tokens=3,
                               do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.shape[1] == 8 and [calls[conv] for conv in convs] == [3] * len(convs)  # prefill and two steps


def test_transformers_path_runs_inside_a_call_of_the_convolution(model, monkeypatch):
    """Padded rows as the kernels' path takes them (transformers' layer; here its torch functions, since the
    kernels are not installed): conv1d is called once per layer, and the logits are the per-span path's."""
    from lavis_ds.models import linear_attention

    llm, embeds = model.llm_model, torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(3))
    convs = [layer.linear_attn.conv1d for layer in llm.model.layers if hasattr(layer, "linear_attn")]
    with torch.no_grad():
        per_span = llm(inputs_embeds=embeds, use_cache=False).logits
        monkeypatch.setattr(linear_attention, "kernels_take_boundaries", lambda: True)
        calls = Counter()
        hooks = [conv.register_forward_pre_hook(lambda module, args: calls.update([module])) for conv in convs]
        try:
            theirs = llm(inputs_embeds=embeds, use_cache=False).logits
        finally:
            for hook in hooks:
                hook.remove()
    assert [calls[conv] for conv in convs] == [1] * len(convs)
    torch.testing.assert_close(theirs, per_span, atol=1e-5, rtol=0)


def test_packed_samples_lay_the_spans_end_to_end():
    spans = PackedSamples.of([[3, 2], [4, 1]], "cpu")
    assert spans.spans == ((0, 0, 3), (0, 3, 5), (1, 0, 4), (1, 4, 5))
    assert spans.cu_seqlens.tolist() == [0, 3, 5, 9, 10]
    assert spans.seq_idx.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]] and spans.seq_idx.dtype == torch.int32


def test_lora_covers_linear_attention_and_each_decoder_layer_is_a_unit(qwen3_5_tokenizer):
    model = _build(qwen3_5_tokenizer, freeze_llm=True, get_lora=True, lora_r=4).eval()
    targets = set(model.llm_model.peft_config["default"].target_modules)
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                       "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
    assert [type(block).__name__ for block in model.repeated_blocks()[-2:]] == ["Qwen3_5DecoderLayer"] * 2
    with torch.no_grad():  # packed rows reach the layers through peft's wrapper too
        padded = model(model.prepare_batch(_batch()))["loss_sum"]
        packed = model(model.prepare_batch(_batch(), pack_to=512))["loss_sum"]
    torch.testing.assert_close(packed, padded, atol=1e-6, rtol=1e-6)
    # Merged for export: transformers' own class, whose config.json a plain from_pretrained reads.
    assert type(model.merge_lora()) is Qwen3_5ForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(model(model.prepare_batch(_batch()))["loss_sum"], padded, atol=1e-4, rtol=1e-5)


def test_packing_refuses_an_llm_whose_recurrent_layers_take_no_boundaries(model):
    plain = Qwen3_5ForCausalLM(model.llm_model.config)  # transformers' own: its layers read no boundaries
    original, model.llm_model = model.llm_model, plain
    try:
        with pytest.raises(InputError, match=r"run\.packing: the LLM Qwen3_5ForCausalLM \(model_type qwen3_5_text\) "
                                             r"has recurrent layers \(linear_attention\) .* run\.packing: false"):
            model(model.prepare_batch(_batch(), pack_to=512))
        assert torch.isfinite(model(model.prepare_batch(_batch()))["loss"])  # padded rows need no boundaries
    finally:
        model.llm_model = original


def test_packing_an_llm_with_recurrent_layers_that_take_no_boundaries_is_a_config_problem(tmp_path):
    run = {"packing": True, "max_seq_len": 512}
    [problem] = packing_problems(run, {"llm_config": {"model_type": "qwen3_next"}})
    assert problem.startswith("run.packing: the LLM Qwen3NextForCausalLM (model_type qwen3_next) has recurrent "
                              "layers (linear_attention)") and problem.endswith("Set run.packing: false for this LLM")
    (tmp_path / "config.json").write_text('{"model_type": "lfm3"}')  # a folder says its own type: short convolutions
    [problem] = packing_problems(run, {"llm_model": str(tmp_path)})
    assert "Lfm3ForCausalLM (model_type lfm3) has recurrent layers (conv)" in problem
    assert packing_problems(run, {"llm_config": TEXT}) == packing_problems(run, {"llm_config": {}}) == []
    assert packing_problems({**run, "packing": False}, {"llm_config": {"model_type": "qwen3_next"}}) == []


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5"])
def test_packing_qwen3_5_is_accepted_under_every_engine_without_its_kernels(model_type):
    """The checks the config check runs for packing (the engine's own model check, the recurrent-layer check) pass
    Qwen3.5 under ZeRO-3 too: each of its parts with weights runs once per packed forward (the test above), so ranks
    gather alike; tests/test_arch_runs.py trains it packed under ZeRO-3 on 2 processes."""
    from lavis_ds.common import registry as reg

    assert not kernels_take_boundaries()
    model = {"llm_config": {"model_type": model_type}}
    for run in ({"zero_stage": 3}, {"zero_stage": 2}, {"runner": "runner_fsdp"}):
        run = {"packing": True, "max_seq_len": 512, **run}
        engine = reg.engines.get(run.get("runner", "runner_deepspeed"))
        assert engine.config.model_problems(run, model) + packing_problems(run, model) == [], run


def test_the_vision_language_model_type_is_named_in_llm_config_and_its_folder_loads_the_language_model(
        model, tmp_path, caplog):
    [problem] = llm_config_problems({**TEXT, "model_type": "qwen3_5"})
    assert "'qwen3_5' is a vision-language model" in problem and "model_type: qwen3_5_text" in problem
    config = Qwen3_5Config(text_config={k: v for k, v in TEXT.items() if k != "model_type"} | {"vocab_size": 300},
                           vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                                          "out_hidden_size": 64})
    torch.manual_seed(2)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        llm = Recipe(tmp_path, None, None).whole()
    assert "vision-language folder" in caplog.text and "model.visual.*" in caplog.text
    assert isinstance(llm, Qwen3_5TextForCausalLM) and not any("visual" in n for n, _ in llm.named_parameters())
    saved = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path)
    torch.testing.assert_close(llm.model.layers[0].linear_attn.in_proj_qkv.weight,
                               saved.model.language_model.layers[0].linear_attn.in_proj_qkv.weight)
    empty = Recipe(tmp_path, None, None).from_config()  # the partitioned engines' build: the language model too
    assert isinstance(empty, Qwen3_5TextForCausalLM) and empty.config.model_type == "qwen3_5_text"


def test_the_flop_model_counts_the_gated_delta_net_layers(model):
    """Forward FLOPs of the LLM on one 128-token sequence (two whole chunks) as FlopCounterMode measures them; the
    one difference is the convolution's K - 1 outputs before the start and K - 1 past the end, which the per-span
    path computes over the zeros laid before the sequence and its padding after it, and drops."""
    llm, tokens = model.llm_model, 128
    flops = compose(ZERO, lambda n: ZERO, False, llm, head_at_every_position=True)
    conv_edges = sum(2 * 2 * (c.kernel_size[0] - 1) * c.kernel_size[0] * c.out_channels
                     for c in (layer.linear_attn.conv1d for layer in llm.model.layers[::2]))
    # The math attention backend: the counter has no formula for CPU's fused kernel (tests/test_flops.py).
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        llm(inputs_embeds=torch.randn(1, tokens, 64), use_cache=False)
    expected = flops.llm(tokens).forward + flops.head.forward * tokens + conv_edges
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9)
