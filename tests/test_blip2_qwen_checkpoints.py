"""blip2_qwen checkpoints written before it was the ``eva_vit_g`` tower + ``qformer`` connector composition still load.

``tests/fixtures/blip2_qwen_before/`` (made by its ``make.py`` when blip2_qwen held MiniGPT4Qwen's flat attributes
``visual_encoder``, ``ln_vision``, ``qformer``, ``query_tokens``, ``llm_proj``) holds a DeepSpeed and an FSDP2 run
checkpoint, a ``--format lavis_ds`` export, and the logits each gave on a fixed input. Read with today's code, each
gives the same logits, and every saved key lands on a parameter.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from lavis_ds.apps.export_io import find_checkpoint, load_exported, read_checkpoint
from lavis_ds.build import build_model
from lavis_ds.models.export_folder import load_trained_weights

FIXTURE = Path(__file__).parent / "fixtures" / "blip2_qwen_before"
RECORDED = load_file(FIXTURE / "logits.safetensors")
_spec = importlib.util.spec_from_file_location("blip2_qwen_before_make", FIXTURE / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)  # its fixed input and logits, the ones the recording used
FLAT_PREFIXES = ("visual_encoder.", "ln_vision.", "qformer.", "query_tokens", "llm_proj.", "llm_model.")


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp"])
def test_run_checkpoint_gives_the_recorded_logits(engine):
    weights, info = read_checkpoint(find_checkpoint(FIXTURE / f"{engine}_run"))
    assert all(key.startswith(FLAT_PREFIXES) for key in weights)  # the file holds MiniGPT4Qwen's names
    assert any(key.startswith("visual_encoder.") for key in weights)
    section = OmegaConf.to_container(info["config"].model, resolve=True)
    section["tokenizer"] = str(FIXTURE / "tokenizer")  # recorded as the absolute path it was made at
    model = build_model(OmegaConf.create(section))
    load_trained_weights(model, weights, engine)  # every saved key names a parameter, every trainable one is given
    torch.testing.assert_close(make.logits_of(model), RECORDED[engine], rtol=0, atol=1e-6)


def test_export_gives_the_recorded_logits():
    torch.testing.assert_close(make.logits_of(load_exported(FIXTURE / "export")), RECORDED["export"], rtol=0,
                               atol=1e-6)
