"""The FLOP model of every registered architecture against torch's FlopCounterMode on its tiny preset: tower,
connector and LLM each report their own, for frozen and trained parts, text-only and multi-image samples (Qwen-VL:
images of three sizes, each counted by its grid).

torch.utils.flop_counter counts matmuls only, as the FLOP model does: they agree to float rounding. The gaps:
torch 2.14 has no FLOP formula for CPU's fused attention kernel and counts it as 0, so attention runs on the math
backend here, whose matmuls it counts; it counts a grouped convolution's weight gradient as a dense one's, corrected
here (``grouped_conv_backward``); and Qwen3.5's torch path computes more than the model
(``_counted_beyond_the_model``)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from archs import ARCHITECTURES, build_tiny, mixed_batch, set_trainable
from lavis_ds.models.flops import ZERO
from lavis_ds.models.image_tokens import image_sizes
from lavis_ds.models.image_tokens import per_sample as split_per_sample
from lavis_ds.models.linear_attention import kernels_take_boundaries
from lavis_ds.models.prompt import IGNORE_INDEX

# name: (config overrides, which parts train; a part left out keeps what the build gave it)
RECIPES = {
    "everything trains": ({}, dict(tower=True, connector=True, llm=True)),
    "connector only (LLaVA stage 1, MiniGPT4Qwen)": ({}, dict(tower=False, connector=True, llm=False)),
    "tower trains under a frozen connector and LLM": ({}, dict(tower=True, connector=False, llm=False)),
    "LoRA under a frozen image path": ({"get_lora": True, "freeze_llm": True}, dict(tower=False, connector=False)),
    "full logits (loss_chunks 0)": ({"loss_chunks": 0}, dict(tower=False, connector=True, llm=True)),
}


def _instruction_tokens(model, prepared: dict) -> int:
    """Padded instruction tokens per image, for a connector that reads them (InstructBLIP); else 0."""
    mask = prepared.get("qformer_attention_mask")
    return 0 if mask is None else mask.shape[1]


# (height, width) in merged tokens of the three images of a Qwen-VL batch: three grids; at Qwen2.5-VL's 28 px per
# merged token the last is two 112 px windows.
FLAT_IMAGE_SIDES = [(2, 2), (2, 4), (6, 4)]


def _batch(model) -> dict:
    """``mixed_batch``; for a Qwen-VL architecture with its images at three sizes, as flat patches and grid rows."""
    batch = mixed_batch(model)
    if getattr(model.SETTINGS, "FLAT_FEATURES", False):
        px = model.vision_tower.processing.factor
        visuals = [model.vision_tower.processing.still_patches(torch.randn(3, h * px, w * px))
                   for h, w in FLAT_IMAGE_SIDES]
        batch.update(image=torch.cat([v.pixel_values for v in visuals]),
                     image_grid_thw=torch.stack([v.grid_thw for v in visuals]))
    return batch


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_flop_model_is_what_flop_counter_measures(arch, recipe, tiny_tokenizer_dir, tmp_path):
    overrides, parts = RECIPES[recipe]
    model = build_tiny(arch, tiny_tokenizer_dir, tmp_path, **overrides)
    set_trainable(model, arch, **parts)
    two_images = _measured_as_modelled(model)[-1]
    # Every part costs something, and a frozen part with nothing trainable below it runs forward only.
    assert all(two_images[part].forward > 0 for part in ("tower", "connector", "llm", "head"))
    if parts.get("tower") is False:
        assert two_images["tower"].training == two_images["tower"].forward


# BLIP2-Qwen's own freeze switches (MiniGPT4Qwen's recipe with one thing more trained).
MINIGPT4QWEN = {"freeze_vit": True, "freeze_qformer": True, "freeze_queries": True, "freeze_llm": True}
BLIP2_SWITCHES = {
    "frozen ViT but its position embedding": {**MINIGPT4QWEN, "unfreeze_pos_embed": True},
    "queries only": {**MINIGPT4QWEN, "freeze_queries": False, "freeze_proj": True},
    "LoRA under a frozen projection": {**MINIGPT4QWEN, "get_lora": True, "freeze_proj": True},
}


@pytest.mark.parametrize("switches", BLIP2_SWITCHES)
def test_blip2_freeze_switches_are_counted(switches, tiny_tokenizer_dir, tmp_path):
    _measured_as_modelled(build_tiny("blip2_qwen", tiny_tokenizer_dir, tmp_path, **BLIP2_SWITCHES[switches]))


def _counted_beyond_the_model(model) -> tuple[float, float]:
    """How far above the FLOP model the counter may read, forward and training (never below it): float rounding,
    but more for an LLM with Gated-DeltaNet layers on transformers' torch path (no flash-linear-attention here). That
    path pads each sequence to whole 64-token chunks of the delta rule and computes the convolution's K - 1 outputs
    past its end (1.6 % of the forward on this batch), and its backward multiplies matrices for the delta rule's
    triangular solves (with the padding, 3.7-5.3 % of training here): work of this implementation that the FLOP
    model leaves out, as MFU counts the model's work (test_qwen3_5_llm checks the layer's forward count exactly)."""
    if any(isinstance(m, Qwen3_5GatedDeltaNet) for m in model.modules()) and not kernels_take_boundaries():
        return 0.02, 0.06
    return 1e-9, 1e-9


def grouped_conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                          _output_padding, groups, output_mask, out_shape, **kwargs) -> int:
    """torch's FLOP formula for a convolution's backward, with the weight gradient of a grouped convolution (Qwen3.5's
    depthwise one) counted per group: torch 2.14 counts it as a dense convolution's, ``groups`` times too much."""
    flops = flop_counter.conv_backward_flop.__wrapped__(
        grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed, _output_padding, groups,
        [output_mask[0], False, False], out_shape=out_shape)
    weight = flop_counter.conv_backward_flop.__wrapped__(
        grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed, _output_padding, groups,
        [False, output_mask[1], False], out_shape=out_shape)
    return flops + weight // groups


CORRECTED = {torch.ops.aten.convolution_backward: grouped_conv_backward}


def _measured_as_modelled(model):
    """Check the model's FLOP model against FlopCounterMode on ``_batch``, forward and training; return its parts
    per sample."""
    batch = model.prepare_batch(_batch(model))
    padded_len = batch["input_ids"].shape[1]  # the counter sees the padding too
    supervised = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
    text = _instruction_tokens(model, batch)
    flops = model.flop_model()
    sizes = image_sizes(batch)
    per_sample = [flops.per_sample(padded_len, n, images=i, text_tokens=text, image_sizes=mine)
                  for n, i, mine in zip(supervised, batch["num_images"], split_per_sample(sizes, batch["num_images"]))]
    expected = sum((parts["total"] for parts in per_sample), ZERO)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            model(batch)
        with FlopCounterMode(display=False, custom_mapping=CORRECTED) as training:
            model(batch)["loss"].backward()
    for counted, modelled, beyond in zip((forward, training), (expected.forward, expected.training),
                                         _counted_beyond_the_model(model)):
        assert modelled * (1 - 1e-9) <= counted.get_total_flops() <= modelled * (1 + beyond)
    # What the logged MFU reads: a step's counts (padding counted here as the counter sees it).
    assert flops.training_flops(3, 3 * padded_len, 3 * padded_len**2, sum(supervised), 3 * text,
                                3 * text**2, Counter(sizes)) == pytest.approx(expected.training, rel=1e-9)
    return per_sample
