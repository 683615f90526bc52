"""Preemption: SIGTERM finishes the optimizer step on every rank, saves, says so; the same command resumes there.

SLURM and Kubernetes send SIGTERM before they kill a job; torchrun forwards it to every worker.
SIGINT (Ctrl-C) stops the same way without saving.
"""
from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import demo_storage_fixture
from run_utils import (EPOCHS, REPO, STEPS_PER_EPOCH, command, comparable, complete_steps, env, noisy_config,
                       output_of, run_train, start, tiny_config, tracebacks, train_steps, write_yaml)


demo_storage = demo_storage_fixture(num_train=64, num_val=16, num_test=8)


def signal_after_step(cmd: list[str], out: Path, log: Path, step: int, signum: int) -> subprocess.CompletedProcess:
    """Run ``cmd``; send ``signum`` to it (the launcher, if any) once ``step`` is in metrics.jsonl."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=f, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").is_file() and len(complete_steps(out)) >= step:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}:\n{log.read_text()}"
        proc.send_signal(signum)
        code = proc.wait(timeout=120)
    return subprocess.CompletedProcess(cmd, code, log.read_text(), "")


def test_sigterm_under_torchrun_saves_and_the_same_command_continues_bit_for_bit(tmp_path, demo_storage):
    reference_out, out = tmp_path / "reference", tmp_path / "preempted"
    configs = {}
    for name, folder in (("reference", reference_out), ("preempted", out)):
        cfg = noisy_config(folder, demo_storage, 2, "fp32")
        cfg["run"]["save_freq_steps"] = 0  # epoch ends only: the checkpoint mid-epoch is the one SIGTERM saves
        configs[name] = write_yaml(tmp_path / f"{name}.yaml", cfg)
    total = STEPS_PER_EPOCH * EPOCHS
    reference = start(configs["reference"])  # beside the preempted run (torchrun's): one wall-clock wait
    stopped = signal_after_step(command(configs["preempted"]), out, tmp_path / "preempted.log",
                                STEPS_PER_EPOCH + 2, signal.SIGTERM)
    assert reference.wait(timeout=600) == 0, output_of(reference)[-4000:]

    found = re.search(r"lavis_ds: stopped by SIGTERM after optimizer step (\d+): saved (\S+); run the same command "
                      r"to continue from there", stopped.stdout)
    assert found, stopped.stdout[-4000:]
    step = int(found.group(1))
    assert STEPS_PER_EPOCH + 2 <= step < total and stopped.returncode != 0
    assert stopped.stdout.count("lavis_ds: stopped by SIGTERM") == 1  # both ranks stopped there; one says so
    assert not tracebacks(stopped.stdout), stopped.stdout[-4000:]
    saved = out / "checkpoints" / f"step_{step}"
    assert found.group(2) == str(saved)
    assert {p.name for p in saved.iterdir()} >= {"lavis_ds_complete.json", "rng_state_rank0.pt", "rng_state_rank1.pt"}
    assert [m["step"] for m in train_steps(out)] == list(range(1, step + 1))  # the step in flight finished

    rerun = run_train(configs["preempted"])
    assert f"resumed from {saved} at epoch" in rerun.stdout
    assert comparable(train_steps(out)) == comparable(train_steps(reference_out))


def test_sigint_finishes_the_step_and_exits_without_saving(tmp_path, demo_storage):
    out = tmp_path / "interrupted"
    cfg = tiny_config(out, demo_storage, stage=2, max_epoch=4, save_freq_steps=0)
    path = write_yaml(tmp_path / "run.yaml", cfg)
    stopped = signal_after_step(command(path, nproc=0), out, tmp_path / "run.log", 20, signal.SIGINT)

    assert stopped.returncode == 130, stopped.stdout[-4000:]
    found = re.search(r"lavis_ds: stopped by SIGINT after optimizer step (\d+) without saving; the same command "
                      r"continues from (\S+)", stopped.stdout)
    assert found, stopped.stdout[-4000:]
    step = int(found.group(1))
    assert found.group(2) == str(out / "checkpoints" / "step_16")  # the epoch-end checkpoint before the signal
    assert not tracebacks(stopped.stdout)
    assert [m["step"] for m in train_steps(out)] == list(range(1, step + 1))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_16"]
