"""End to end: train.py on real DeepSpeed engines, 2 processes, the tiny BLIP2-Qwen."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import demo_storage_fixture
from lavis_ds.models import Blip2Qwen
from lavis_ds.optim.lr_schedulers import LinearWarmupCosineLR
from run_utils import REPO, env, free_port, metrics, run_train, tiny_config, train_steps, write_yaml


demo_storage = demo_storage_fixture(num_train=128, num_val=16, num_test=8)


def _train(tmp_path, demo_storage, name, nproc=2, **kw):
    out = tmp_path / name
    cfg = write_yaml(tmp_path / f"{name}.yaml", tiny_config(out, demo_storage, **kw))
    run_train(cfg, nproc=nproc)
    return train_steps(out)


@pytest.fixture(scope="module")
def stage0_fp32(tmp_path_factory, demo_storage):
    # Forked, as the stages it is compared with (harness/forked.py); the launchers themselves are the subject of
    # test_deepspeed_launcher_passes_local_rank_and_runs_two_processes, test_preemption and test_multinode.
    return _train(tmp_path_factory.mktemp("stage0"), demo_storage, "stage0", stage=0, accum=2, max_epoch=2)


def _falls(losses):
    return sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3


def test_stage0_fp32_trains(stage0_fp32):
    losses = [m["loss"] for m in stage0_fp32]
    assert len(losses) == 2 * 128 // 16  # 2 epochs of 128 samples in global batches of 4 x 2 x 2
    assert all(math.isfinite(x) for x in losses) and _falls(losses)
    assert all(m["grad_norm"] is not None and m["grad_norm"] > 0 for m in stage0_fp32)
    assert [m["step"] for m in stage0_fp32] == list(range(1, 17))


def test_throughput_is_summed_over_both_processes(stage0_fp32, demo_storage):
    """Each process counts its own tokens; a logged step's rates are over both (rank 0's alone: about half)."""
    cfg = {**Blip2Qwen.default_config("tiny"), "tokenizer": str(demo_storage / "tokenizer")}
    prompt = Blip2Qwen.from_config(cfg).llm.prompt
    records = json.loads((demo_storage / "annotations" / "train.json").read_text())
    lengths = [len(prompt.training_example(r["instruction"], r["output"])[0]) for r in records]  # 52 to 75 tokens
    assert len(stage0_fp32) == 16  # every step logged its rates
    for m in stage0_fp32:
        assert min(lengths) <= m["tokens_per_sec"] / m["samples_per_sec"] <= max(lengths)  # the same seconds
        assert 0 < m["supervised_tokens_per_sec"] < m["tokens_per_sec"] and 0 <= m["padding_share"] < 1
        assert m["peak_memory_gib"] > 0 and m["tflops_per_device"] > 0 and "mfu" not in m  # a CPU: no peak known


@pytest.mark.parametrize("stage", [3])  # the stage that partitions everything; 1 and 2 only cost suite time
def test_fp32_stages_match_stage0(tmp_path, demo_storage, stage0_fp32, stage):
    steps = _train(tmp_path, demo_storage, f"stage{stage}", stage=stage, accum=2, max_epoch=2)
    assert len(steps) == len(stage0_fp32) == 16
    assert [m["loss"] for m in steps] == pytest.approx([m["loss"] for m in stage0_fp32], rel=1e-4, abs=1e-5)
    assert [m["lr"] for m in steps] == [m["lr"] for m in stage0_fp32]
    # The FLOP function reads ZeRO-3's partitioned model as the whole one: the same samples cost the same FLOPs.
    assert [m["tflops_per_device"] / m["tokens_per_sec"] for m in steps] == pytest.approx(
        [m["tflops_per_device"] / m["tokens_per_sec"] for m in stage0_fp32], rel=1e-9)


def test_optimizer_offload_trains_and_resumes_bit_for_bit(tmp_path, demo_storage):
    """ZeRO-Offload steps DeepSpeedCPUAdam, whose C++ kernel keeps beta powers outside the checkpoint."""
    out = tmp_path / "offload"
    cfg = tiny_config(out, demo_storage, stage=2, max_epoch=2, save_freq_steps=5)
    cfg["run"]["offload_optimizer"] = True
    run_train(write_yaml(tmp_path / "offload.yaml", cfg), timeout=900)
    handed = yaml.safe_load((out / "config.yaml").read_text())["run"]["deepspeed_config"]
    assert handed["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}  # the run key reached DeepSpeed
    uninterrupted = train_steps(out)
    losses = [m["loss"] for m in uninterrupted]
    assert all(math.isfinite(x) for x in losses) and _falls(losses)

    # Resuming from step 5 drifted by an ulp before the engine replayed the kernel's counter.
    resumed_out = tmp_path / "resumed"
    shutil.copytree(out, resumed_out)
    for folder in (resumed_out / "checkpoints").glob("step_*"):
        if int(folder.name.removeprefix("step_")) > 5:
            shutil.rmtree(folder)
    cfg["run"]["output_dir"] = str(resumed_out)
    rerun = run_train(write_yaml(tmp_path / "resumed.yaml", cfg), timeout=900)
    assert f"resumed from {resumed_out / 'checkpoints' / 'step_5'}" in rerun.stdout
    assert _numbers(train_steps(resumed_out)) == _numbers(uninterrupted)


def _numbers(steps):
    return [(m["step"], m["loss"], m["lr"], m["grad_norm"]) for m in steps]


def test_lr_follows_the_schedule_per_optimizer_step_with_accumulation(tmp_path, demo_storage):
    out = tmp_path / "accum4"
    cfg = tiny_config(out, demo_storage, stage=1, micro=2, accum=4, max_epoch=3, warmup_steps=3, warmup_lr=1e-5)
    run_train(write_yaml(tmp_path / "accum4.yaml", cfg), nproc=2)
    steps = train_steps(out)
    total = 3 * 128 // (2 * 4 * 2)
    assert [m["step"] for m in steps] == list(range(1, total + 1))
    formula = LinearWarmupCosineLR(_NoOptimizer(), init_lr=1e-3, min_lr=1e-5, warmup_lr=1e-5, warmup_steps=3,
                                   total_steps=total, steps_per_epoch=total // 3)
    assert [m["lr"] for m in steps] == pytest.approx([formula.lr_at(s) for s in range(total)], rel=1e-12)
    assert [m["epoch"] for m in steps] == [s // (total // 3) for s in range(total)]


class _NoOptimizer:
    param_groups: list = []


def test_single_process_without_launcher_and_eval_lines(tmp_path, demo_storage):
    out = tmp_path / "single"
    cfg = tiny_config(out, demo_storage, stage=2, valid_splits=["val"], test_splits=["test"],
                      generate={"max_new_tokens": 4})
    run_train(write_yaml(tmp_path / "single.yaml", cfg), nproc=0, launcher="launch")  # `python train.py`
    lines = metrics(out)
    assert (out / "config.yaml").is_file() and any((out / "tb").iterdir())
    val = [m for m in lines if m.get("split") == "val"]
    test = [m for m in lines if m.get("split") == "test"]
    assert len(val) == 1 and math.isfinite(val[0]["loss"]) and val[0]["num_tokens"] > 0
    assert len(test) == 1 and test[0]["num_samples"] == 8 and 0 <= test[0]["exact_match"] <= 1
    assert {"image", "expected", "generated"} <= set(test[0]["samples"][0])
    steps = train_steps(out)
    assert [m["step"] for m in steps] == list(range(1, 128 // 4 + 1))  # one process, global batches of 4
    for m in steps:
        assert {"step", "epoch", "loss", "lr", "grad_norm", "samples_per_sec"} <= set(m)


def test_deepspeed_launcher_passes_local_rank_and_runs_two_processes(tmp_path, demo_storage):
    out = tmp_path / "launcher"
    cfg = write_yaml(tmp_path / "launcher.yaml", tiny_config(out, demo_storage, stage=1))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", f"--master_port={free_port()}",
           str(REPO / "train.py"), "--cfg-path", str(cfg)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--local_rank=1" in proc.stdout + proc.stderr  # the launcher's own command line for rank 1
    assert len(train_steps(out)) == 128 // (4 * 2)  # a global batch of 4 x 2 processes
