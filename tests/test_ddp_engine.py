"""A third engine from a user's module (tests/ddp_engine.py: torch DistributedDataParallel, under `imports:`):
the shared loop trains on it on 2 processes, and a run SIGKILLed anywhere continues bit for bit."""
from __future__ import annotations

import json
import random

import pytest

from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import (EPOCHS, SAVE_EVERY, STEPS_PER_EPOCH, comparable, kill_after_step, noisy_config, run_train,
                       start, train_steps, write_yaml)


@pytest.fixture(scope="module")
def demo_storage(tmp_path_factory):
    storage = tmp_path_factory.mktemp("demo") / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=64, num_val=16, num_test=8))
    return storage


def _config(tmp_path, demo_storage, name: str):
    cfg = noisy_config(tmp_path / name, demo_storage, stage=2, dtype="fp32", runner="runner_ddp_test")
    cfg["imports"] = ["ddp_engine"]
    return write_yaml(tmp_path / f"{name}.yaml", cfg)


def test_a_users_ddp_engine_from_imports_trains_and_a_killed_run_continues_bit_for_bit(tmp_path, demo_storage):
    reference, killed = _config(tmp_path, demo_storage, "reference"), _config(tmp_path, demo_storage, "killed")
    total = STEPS_PER_EPOCH * EPOCHS
    kill_step = random.randint(SAVE_EVERY + 1, total - 2)
    reference_job = start(reference)
    kill_after_step(start(killed), tmp_path / "killed", kill_step)
    rerun = run_train(killed)
    assert reference_job.wait(timeout=600) == 0

    expected = comparable(train_steps(tmp_path / "reference"))
    losses = [loss for _, _, loss, _, _ in expected]
    assert len(expected) == total and sum(losses[-3:]) < 0.9 * sum(losses[:3])  # it trains
    assert "resumed from" in rerun.stdout, f"kill after step {kill_step}: no resume\n{rerun.stdout[-2000:]}"
    assert comparable(train_steps(tmp_path / "killed")) == expected, f"killed after step {kill_step}"
    last = tmp_path / "killed" / "checkpoints" / f"step_{total}"
    marker = json.loads((last / "lavis_ds_complete.json").read_text())
    assert marker["runner"] == "runner_ddp_test" and marker["world_size"] == 2 and (last / "ddp.pt").is_file()
