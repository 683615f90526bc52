"""llava, qwen2_vl and instructblip checkpoints written before the model classes were refactored into parts still
load and compute what they computed.

``tests/fixtures/models_before/`` (made by its ``make.py`` with the code before that refactor) holds, for each of
the three, a DeepSpeed ZeRO-0 run checkpoint (qwen2_vl's also under FSDP2), a ``--format lavis_ds`` export, the
state_dict keys of the model and the logits each gave on a fixed input. Read with today's code, each gives the same
logits and the same keys (state_dict keys are the file format: ``llm_model.*``, ``vision_tower.*``,
``connector.*``).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lavis_ds.apps.export_io import load_exported

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "models_before"
RECORDED = load_file(FIXTURE / "logits.safetensors")
KEYS = json.loads((FIXTURE / "keys.json").read_text())
_spec = importlib.util.spec_from_file_location("models_before_make", FIXTURE / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)  # its fixed input, logits and rebuild, the ones the recording used
RUNS = [(arch, engine) for arch, engines in make.ENGINES.items() for engine in engines]


def assert_as_recorded(model: torch.nn.Module, arch: str, logits_key: str) -> None:
    assert sorted(model.state_dict()) == KEYS[arch]
    torch.testing.assert_close(make.logits_of(model), RECORDED[logits_key], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("arch", "engine"), RUNS)
def test_run_checkpoint_gives_the_recorded_keys_and_logits(arch, engine):
    """Rebuilt as export.py rebuilds it (every saved key names a parameter, every trainable one is given)."""
    assert_as_recorded(make.rebuilt(arch, engine), arch, f"{arch}_{engine}")


@pytest.mark.parametrize("arch", list(make.ENGINES))
def test_export_gives_the_recorded_keys_and_logits(arch, monkeypatch):
    monkeypatch.chdir(REPO)  # instructblip's export names its Q-Former tokenizer relative to the repository root
    assert_as_recorded(load_exported(FIXTURE / f"{arch}_export"), arch, f"{arch}_export")
