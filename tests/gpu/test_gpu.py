"""The tiny demo model on a GPU under torchrun with NCCL: the three engines in bf16, a SIGKILL continued bit for
bit with run.deterministic, an engine switch, export and generate on the GPU, and what NCCL refuses.

Every launch is the command a user types (``torchrun ... train.py``): NCCL is the default group, so any
control collective on a CPU tensor outside ``common/comm.py`` would stop these runs at their first step.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import (REPO, comparable, continue_from, env, free_port, kill_after_step, run_train, start,
                       tiny_config, train_steps, write_yaml)

ENGINES = {"zero2": ("runner_deepspeed", 2), "zero3": ("runner_deepspeed", 3), "fsdp": ("runner_fsdp", 3)}
STEPS = 16  # 128 samples, micro 8, one process


@pytest.fixture(scope="module")
def demo_storage(tmp_path_factory):
    storage = tmp_path_factory.mktemp("gpu") / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=128, num_val=16, num_test=16))
    return storage


def _config(out, demo_storage, engine: str, dtype: str = "bf16", **run) -> dict:
    engine_name, stage = ENGINES[engine]
    cfg = tiny_config(out, demo_storage, stage=stage, dtype=dtype, micro=8, runner=engine_name, valid_splits=["val"],
                      test_splits=["test"], save_freq_steps=4, **run)
    cfg["datasets"]["demo_shapes"]["build_info"].update(num_train=128, num_val=16, num_test=16)
    return cfg


@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_engine_trains_in_bf16_on_nccl(tmp_path, demo_storage, engine):
    cfg = write_yaml(tmp_path / "run.yaml", _config(tmp_path / "out", demo_storage, engine))
    proc = run_train(cfg, nproc=1, launcher="launch")
    steps = train_steps(tmp_path / "out")
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1)), proc.stderr[-3000:]
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"]
    assert "No backend type" not in proc.stderr


@pytest.mark.parametrize("engine", ["zero2", "fsdp"])
def test_sigkill_and_rerun_continue_bit_for_bit_with_run_deterministic(tmp_path, demo_storage, engine):
    runs = {}
    for name in ("reference", "killed"):
        runs[name] = write_yaml(tmp_path / f"{name}.yaml", _config(tmp_path / name, demo_storage, engine,
                                                                  deterministic=True, max_epoch=2))
    run_train(runs["reference"], nproc=1, launcher="launch")
    kill_after_step(start(runs["killed"], nproc=1, launcher="launch"), tmp_path / "killed", 7)
    rerun = run_train(runs["killed"], nproc=1, launcher="launch")
    assert "resumed from" in rerun.stdout
    assert comparable(train_steps(tmp_path / "killed")) == comparable(train_steps(tmp_path / "reference"))


def test_a_deepspeed_run_continues_under_fsdp(tmp_path, demo_storage):
    zero2 = write_yaml(tmp_path / "zero2.yaml", _config(tmp_path / "zero2", demo_storage, "zero2", dtype="fp32"))
    run_train(zero2, nproc=1, launcher="launch")
    fsdp = write_yaml(tmp_path / "fsdp.yaml", _config(tmp_path / "fsdp", demo_storage, "fsdp", dtype="fp32"))
    proc = continue_from(tmp_path / "zero2" / "checkpoints" / "step_8", fsdp, tmp_path / "fsdp", nproc=1)
    assert "under runner_fsdp" in proc.stdout
    reference = {m["step"]: m["loss"] for m in train_steps(tmp_path / "zero2")}
    for m in train_steps(tmp_path / "fsdp"):
        assert abs(m["loss"] - reference[m["step"]]) <= 1e-3 * reference[m["step"]], m  # TF32 on both sides


def test_export_and_generate_on_the_gpu(tmp_path, demo_storage):
    cfg = write_yaml(tmp_path / "run.yaml", _config(tmp_path / "out", demo_storage, "zero2", max_epoch=2))
    run_train(cfg, nproc=1, launcher="launch")
    subprocess.run([sys.executable, "export.py", str(tmp_path / "out"), "--out", str(tmp_path / "export")],
                   cwd=REPO, env=env(), check=True, capture_output=True)
    answers = tmp_path / "answers.jsonl"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                           f"--master_port={free_port()}", "-m",
                           "lavis_ds.apps.generate", "--model", str(tmp_path / "export"), "--device", "cuda",
                           "--data", str(demo_storage / "annotations" / "test.json"), "--images",
                           str(demo_storage / "images"), "--out", str(answers)],
                          cwd=REPO, env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in answers.read_text().splitlines()]
    assert len(lines) == 16 and all(line.get("answer") for line in lines)


def test_two_processes_on_one_gpu_are_refused_by_name(tmp_path, demo_storage):
    if torch.cuda.device_count() > 1:
        pytest.skip("this machine has a GPU per process: nothing to refuse")
    cfg = write_yaml(tmp_path / "run.yaml", _config(tmp_path / "out", demo_storage, "zero2"))
    proc = run_train(cfg, nproc=2, launcher="launch", check=False)
    assert proc.returncode != 0
    assert "lavis_ds: local rank 1 has no GPU of its own: this node shows 1 GPU(s)" in proc.stderr


def test_no_host_sync_per_micro_batch(tmp_path, demo_storage, monkeypatch):
    """Build the trainer in this process (one process, NCCL) and step with accumulation 4 under CUDA's sync debug
    mode: the synchronisations lavis_ds's own lines cause in a step do not grow with the micro-batches."""
    from lavis_ds.build import build_trainer
    from lavis_ds.common import dist
    from lavis_ds.config import load_config
    from lavis_ds.runners.losses import check_losses

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.set_single_process_defaults()
    dist.init_distributed()  # NCCL, as train.py starts runner_fsdp
    counts = {}
    for accum in (1, 4):
        cfg = _config(tmp_path / f"a{accum}", demo_storage, "fsdp", accum=accum)
        trainer = build_trainer(load_config(write_yaml(tmp_path / f"a{accum}.yaml", cfg)))
        trainer.setup()  # the engine and the data order, as train() starts
        micro = trainer.data.next_step(trainer.data.epoch(0, 0))  # prepared on the host, as the loop's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                losses, last_backward = trainer.engine.forward_backward(micro, None)
                last_backward()
                check_losses(trainer, losses)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[accum] = sum("lavis_ds" in w.filename for w in caught)
    assert counts[4] == counts[1], counts
