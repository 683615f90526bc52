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

from conftest import demo_storage_fixture
from run_utils import (EPOCHS, REPO, STEPS_PER_EPOCH, command, comparable, complete_steps, env, noisy_config,
                       output_of, run_train, start, tiny_config, tracebacks, train_steps, write_yaml)


demo_storage = demo_storage_fixture(num_train=64, num_val=16, num_test=8)


def signal_after_step(proc, out: Path, step: int, signum: int) -> int:
    """Send ``signum`` to ``proc`` (the launcher, if any) once ``step`` is in metrics.jsonl; its exit code."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").is_file() and len(complete_steps(out)) >= step:
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}"
    proc.send_signal(signum)
    return proc.wait(timeout=120)


def test_sigterm_under_torchrun_saves_and_the_same_command_continues_bit_for_bit(tmp_path, demo_storage):
    reference_out, out = tmp_path / "reference", tmp_path / "preempted"
    configs = {}
    for name, folder in (("reference", reference_out), ("preempted", out)):
        cfg = noisy_config(folder, demo_storage, 2, "fp32")
        cfg["run"]["save_freq_steps"] = 0  # epoch ends only: the checkpoint mid-epoch is the one SIGTERM saves
        configs[name] = write_yaml(tmp_path / f"{name}.yaml", cfg)
    total = STEPS_PER_EPOCH * EPOCHS
    reference = start(configs["reference"])  # beside the preempted run (torchrun's): one wall-clock wait
    with open(tmp_path / "preempted.log", "w") as log:
        launched = subprocess.Popen(command(configs["preempted"]), cwd=REPO, env=env(), stdout=log,
                                    stderr=subprocess.STDOUT)
        code = signal_after_step(launched, out, STEPS_PER_EPOCH + 2, signal.SIGTERM)
    stopped = subprocess.CompletedProcess(launched.args, code, (tmp_path / "preempted.log").read_text(), "")
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
    job = start(path, nproc=0)  # `python train.py`'s main() in a forked process (harness/forked.py)
    code = signal_after_step(job, out, 20, signal.SIGINT)
    stopped = subprocess.CompletedProcess([], code, output_of(job), "")

    assert stopped.returncode == 130, stopped.stdout[-4000:]
    found = re.search(r"lavis_ds: stopped by SIGINT after optimizer step (\d+) without saving; the same command "
                      r"continues from (\S+)", stopped.stdout)
    assert found, stopped.stdout[-4000:]
    step = int(found.group(1))
    assert found.group(2) == str(out / "checkpoints" / "step_16")  # the epoch-end checkpoint before the signal
    assert not tracebacks(stopped.stdout)
    assert [m["step"] for m in train_steps(out)] == list(range(1, step + 1))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_16"]
