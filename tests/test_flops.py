"""The FLOP model of every registered architecture against torch's FlopCounterMode on its tiny preset: tower,
connector and LLM each report their own, for frozen and trained parts, text-only and multi-image samples.

torch.utils.flop_counter counts matmuls only, as the FLOP model does: they agree to float rounding. The one gap:
torch 2.14 has no FLOP formula for CPU's fused attention kernel and counts it as 0, so attention runs on the math
backend here, whose matmuls it counts."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from archs import ARCHITECTURES, FLAT_ARCHITECTURES, build_tiny, mixed_batch, set_trainable
from lavis_ds.models.flops import ZERO
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


# A Qwen-VL tower's cost depends on each image's size: its architectures have no FLOP model per sample (flop_model is
# None, no MFU is logged; the tower's flops_for_grid is tested in test_qwen_vl_parts).
MODELLED = [arch for arch in ARCHITECTURES if arch not in FLAT_ARCHITECTURES]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("arch", MODELLED)
def test_the_flop_model_is_what_flop_counter_measures(arch, recipe, tiny_tokenizer_dir, tmp_path):
    overrides, parts = RECIPES[recipe]
    model = build_tiny(arch, tiny_tokenizer_dir, tmp_path, **overrides)
    set_trainable(model, arch, **parts)
    flops = _measured_as_modelled(model)
    # Every part costs something, and a frozen part with nothing trainable below it runs forward only.
    assert all(part.forward > 0 for part in (flops.tower, flops.connector, flops.llm_per_token, flops.head))
    if parts.get("tower") is False:
        assert flops.tower.training == flops.tower.forward


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


def _measured_as_modelled(model):
    """Check the model's FLOP model against FlopCounterMode on ``mixed_batch``, forward and training; return it."""
    batch = model.prepare_batch(mixed_batch(model))
    padded_len = batch["input_ids"].shape[1]  # the counter sees the padding too
    supervised = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
    text = _instruction_tokens(model, batch)
    flops = model.flop_model()
    per_sample = [flops.per_sample(padded_len, n, images=i, text_tokens=text)
                  for n, i in zip(supervised, batch["num_images"])]
    expected = sum((parts["total"] for parts in per_sample), ZERO)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            model(batch)
        with FlopCounterMode(display=False) as training:
            model(batch)["loss"].backward()
    assert forward.get_total_flops() == pytest.approx(expected.forward, rel=1e-9)
    assert training.get_total_flops() == pytest.approx(expected.training, rel=1e-9)
    # What the logged MFU reads: a step's counts (padding counted here as the counter sees it).
    assert flops.training_flops(3, 3 * padded_len, 3 * padded_len**2, sum(supervised), 3 * text,
                                3 * text**2) == pytest.approx(expected.training, rel=1e-9)
    return flops
