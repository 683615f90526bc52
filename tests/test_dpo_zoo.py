"""Every architecture of the zoo (each registered VisionLLM, at its ``tiny`` preset) trains with DPO: reference
log-probs from the starting weights (``ReferenceScorer``, as the precomputed pass scores them; with LoRA, the same
model with its adapters disabled), a few AdamW steps on the same pairs, and the model comes to prefer the chosen
answers. The LoRA reference equals the precomputed one at the start."""
from __future__ import annotations

import pytest
import torch

import lavis_ds  # noqa: F401  (fills the registries)
from archs import build_tiny, image_side
from lavis_ds.common.registry import models
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.objectives import Dpo
from lavis_ds.objectives.reference import REF_CHOSEN, REF_REJECTED, ReferenceScorer, resolve_kind

ARCHITECTURES = sorted(name for name in models if isinstance(models.get(name), type)
                       and issubclass(models.get(name), VisionLLM))
IMG = "<Img><ImageHere></Img>"
# Only LoRA trains: the image path frozen, in each architecture's keys (blip2_qwen's flat switches, a part's `freeze`).
_FROZEN_PARTS = {"vision_tower": {"freeze": True}, "connector": {"freeze": True}}
FROZEN_IMAGE_PATH = {arch: _FROZEN_PARTS for arch in ARCHITECTURES} | {
    "blip2_qwen": dict(freeze_vit=True, freeze_qformer=True, freeze_queries=True, freeze_proj=True)}


def tiny(arch: str, tokenizer_dir, files, **settings) -> VisionLLM:
    """``arch``'s tiny preset (with the Q-Former tokenizer an instruction connector reads, made under ``files``)."""
    torch.manual_seed(0)
    return build_tiny(arch, tokenizer_dir, files, **settings)


def pairs_for(model: VisionLLM) -> dict:
    torch.manual_seed(1)
    size = image_side(model)
    return {"image": torch.randn(2, 3, size, size), "num_images": [1, 1],
            "instruction": [[f"{IMG} What is in the image?"], [f"{IMG} What colour is the ball?"]],
            "output": [[], []], "chosen": ["A cat on a mat.", "It is red."],
            "rejected": ["A dog on the grass.", "It is blue."], "system": [None, None], "index": torch.tensor([0, 1])}


def test_the_zoo_is_found():
    assert "blip2_qwen" in ARCHITECTURES


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_trains_with_dpo(arch, tiny_tokenizer_dir, tmp_path):
    model = tiny(arch, tiny_tokenizer_dir, tmp_path)
    objective = Dpo(beta=0.5, reference="precomputed")
    objective.setup(model)  # dropout off
    raw, scorer = pairs_for(model), ReferenceScorer()
    with torch.no_grad():
        logps = model(scorer.prepare(model, raw))["logps"]  # the root forward, as the engines call it
    batch = {**objective.prepare(model, raw), REF_CHOSEN: logps[:2], REF_REJECTED: logps[2:]}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    margins = []
    for _ in range(6):
        out = model(batch)  # the batch names its objective: the model's forward runs it
        optimizer.zero_grad()
        out["loss_sums"]["pairs"].backward()
        optimizer.step()
        margins.append(float(out["metric_sums"]["rewards/margins"][1]) / 2)
    assert margins[0] == 0.0  # the policy starts as the reference
    assert margins[-1] > 0.05, margins
    objective.take_metric_sums()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_reference_is_the_model_with_its_adapters_disabled(arch, tiny_tokenizer_dir, tmp_path):
    model = tiny(arch, tiny_tokenizer_dir, tmp_path, get_lora=True, freeze_llm=True, **FROZEN_IMAGE_PATH[arch])
    trainable = [name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name]
    objective = Dpo(beta=0.5)
    if trainable:  # e.g. trained token rows: the adapter-disabled model is not the start
        with pytest.raises(Exception, match="reference: 'adapters' is not the starting model"):
            resolve_kind("adapters", model)
        return
    objective.setup(model)
    assert objective.reference == "adapters"
    raw, scorer = pairs_for(model), ReferenceScorer()
    with torch.no_grad():
        precomputed = model(scorer.prepare(model, raw))["logps"]
    batch = objective.prepare(model, raw)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        out = model(batch)
        if step == 0:  # fresh adapters: the adapter-disabled reference is the starting model
            assert float(out["metric_sums"]["rewards/margins"][1]) == pytest.approx(0.0, abs=1e-6)
        optimizer.zero_grad()
        out["loss_sums"]["pairs"].backward()
        optimizer.step()
    with torch.no_grad():  # still the starting model's log-probs after training the adapters
        reference = objective.reference_logps(model, batch, model.image_features(batch).repeat(2, 1))
    torch.testing.assert_close(torch.cat([reference[REF_CHOSEN], reference[REF_REJECTED]]), precomputed,
                               rtol=1e-5, atol=1e-5)
    assert float(out["metric_sums"]["rewards/margins"][1]) != 0.0
