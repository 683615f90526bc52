"""blip2_qwen checkpoints written before it was the ``eva_vit_g`` tower + ``qformer`` connector composition still load.

``tests/fixtures/blip2_qwen_before/`` (made by its ``make.py`` when blip2_qwen held MiniGPT4Qwen's flat attributes
``visual_encoder``, ``ln_vision``, ``qformer``, ``query_tokens``, ``llm_proj``) holds a DeepSpeed and an FSDP2 run
checkpoint, a ``--format lavis_ds`` export, and the logits each gave on a fixed input. Read with today's code, each
gives the same logits, every saved key lands on a parameter, and the ``--format hf`` model of it computes them.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from checkpoint_logits import llm_logits
from lavis_ds.apps.export_io import find_checkpoint, load_exported, read_checkpoint
from lavis_ds.build import build_model
from lavis_ds.models.export_folder import load_trained_weights

FIXTURE = Path(__file__).parent / "fixtures" / "blip2_qwen_before"
RECORDED = load_file(FIXTURE / "logits.safetensors")
_spec = importlib.util.spec_from_file_location("blip2_qwen_before_make", FIXTURE / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)  # its fixed input and logits, the ones the recording used
FLAT_PREFIXES = ("visual_encoder.", "ln_vision.", "qformer.", "query_tokens", "llm_proj.", "llm_model.")


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    """The logits the fixture recorded: over the last positions of ``make.fixed_input``."""
    return llm_logits(model, make.fixed_input(model), make.LAST_POSITIONS)


def rebuilt(engine: str) -> torch.nn.Module:
    """The model of a fixture run checkpoint, rebuilt as export.py rebuilds it."""
    weights, info = read_checkpoint(find_checkpoint(FIXTURE / f"{engine}_run"))
    assert all(key.startswith(FLAT_PREFIXES) for key in weights)  # the file holds MiniGPT4Qwen's names
    assert any(key.startswith("visual_encoder.") for key in weights)
    section = OmegaConf.to_container(info["config"].model, resolve=True)
    section["tokenizer"] = str(FIXTURE / "tokenizer")  # recorded as the absolute path it was made at
    model = build_model(OmegaConf.create(section))
    load_trained_weights(model, weights, engine)  # every saved key names a parameter, every trainable one is given
    return model


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_run_checkpoint_gives_the_recorded_logits(engine):
    torch.testing.assert_close(logits_of(rebuilt(engine)), RECORDED[engine], rtol=0, atol=1e-6)


def test_hf_export_of_the_run_checkpoint_computes_its_logits():
    """Blip2ForConditionalGeneration holding the checkpoint: the model's logits, once ln_vision takes the ViT's
    eps (the one difference no weight carries, which the export notes say)."""
    from lavis_ds.apps.export_hf import to_hf_model

    model = rebuilt("deepspeed").eval()
    model.connector.ln_vision.eps = model.vision_tower.vit.blocks[0].norm1.eps
    batch = model.prepare_batch(make.fixed_input(model))
    with torch.no_grad():
        logits = to_hf_model(model, torch.float32)(pixel_values=batch["image"], input_ids=batch["input_ids"],
                                                   attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits[:, -make.LAST_POSITIONS:], logits_of(model), rtol=0, atol=1e-6)


def test_export_gives_the_recorded_logits():
    torch.testing.assert_close(logits_of(load_exported(FIXTURE / "export")), RECORDED["export"], rtol=0,
                               atol=1e-6)


def test_resuming_a_run_checkpoint_in_the_flat_names_is_refused_with_what_to_do(tmp_path):
    """Its optimizer state follows the parameters' old order: the resume check says so and names the way out."""
    from lavis_ds.runners import checkpoint as ckpt
    from lavis_ds.runners.deepspeed import checkpoint as ds_ckpt
    from lavis_ds.runners.fsdp import checkpoint as fsdp_ckpt

    deepspeed_tag, fsdp_tag = (find_checkpoint(FIXTURE / f"{engine}_run") for engine in ("deepspeed", "fsdp"))
    model = rebuilt("deepspeed")
    deepspeed_states = ds_ckpt.load_file(ds_ckpt.model_states_file(deepspeed_tag))
    for tag, saved in ((deepspeed_tag, ds_ckpt.saved_trainable(deepspeed_states)),
                       (fsdp_tag, fsdp_ckpt.saved_shapes(fsdp_ckpt.read_index(fsdp_tag)))):
        problems = ckpt.trainable_problems(tag, saved, model)
        assert len(problems) == 1 and "the names Blip2Qwen gave them before (" in problems[0], problems
        assert "visual_encoder." in problems[0] and "start a run from the export" in problems[0]
