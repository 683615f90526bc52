"""What the mutation cases (tests/test_mutations.py) do to a run's output folder besides its data and checkpoints:
another run in it (alive, killed, or on another host) and a disk that fills up during a save.

Each is made the way it happens: a real train.py that is still training, or was SIGKILLed, holds or left the
lock; the kernel's own "no space left on device" reaches torch.save through DeepSpeed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from run_utils import kill_after_step, start, train_steps

LOCK = "lavis_ds.lock"


def wait_for_step(job, out: Path, step: int, timeout: float = 300) -> None:
    """Return once ``step`` is in metrics.jsonl (the run is training, its lock taken long before)."""
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        if (out / "metrics.jsonl").is_file() and len(train_steps_so_far(out)) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"the first run ended (exit {job.poll()}) or timed out before step {step}")


def train_steps_so_far(out: Path) -> list[str]:
    return [line for line in (out / "metrics.jsonl").read_text().split("\n")[:-1] if '"split"' not in line]


class BusyFolder:
    """A first train.py training in the case's folder, frozen (SIGSTOP) once it trains: it holds the lock and keeps
    every file as it was while the second run is started on the same YAML. ``check`` then ends it."""

    def __init__(self) -> None:
        self.jobs: dict[Path, object] = {}
        self.before: dict[Path, dict[str, bytes]] = {}

    def setup(self, cfg: Path, out: Path) -> None:
        job = start(cfg, nproc=0)
        wait_for_step(job, out, 1)
        for pid in job.pids:
            os.kill(pid, signal.SIGSTOP)
        self.jobs[out] = job
        self.before[out] = {name: (out / name).read_bytes() for name in (LOCK, "config.yaml", "metrics.jsonl")}

    def check(self, out: Path, output: str) -> None:
        job = self.jobs.pop(out)
        try:
            holder = json.loads(self.before[out][LOCK])
            assert holder["pid"] == job.pid and job.poll() is None  # the first run's rank 0, still there
            named = re.search(r"is in use by another run: process (\d+) on host (\S+), started (.+?) \(lock file", output)
            assert named and named.groups() == (str(holder["pid"]), holder["host"], holder["started"]), output
            after = {name: (out / name).read_bytes() for name in self.before[out]}
            assert after == self.before.pop(out)  # the second run wrote nothing: no config.yaml, no metrics line
        finally:
            job.kill()


def leave_a_killed_runs_lock(cfg: Path, out: Path, step: int) -> int:
    """Run ``cfg`` and SIGKILL it after ``step``: its lock file stays behind. Returns the killed rank 0's pid."""
    job = start(cfg, nproc=0)
    kill_after_step(job, out, step)
    assert json.loads((out / LOCK).read_text())["pid"] == job.pid
    return job.pid


def lock_of_another_host(out: Path) -> dict:
    """The lock file another node's rank 0 writes, for a run this host cannot see."""
    holder = {"pid": 4242, "host": "node-b.cluster", "started": "2026-11-24 21:03:11 +0000",
              "boot_id": "0f5c9a8e-2d1b-4c3e-9a7f-6b5d4c3b2a19", "proc_start": 123456}
    (out / LOCK).write_text(json.dumps(holder, indent=1) + "\n")
    return holder


def fill_disk_at(out: Path, step: int, file: str = "mp_rank_00_model_states.pt") -> None:
    """``file`` of the checkpoint of ``step`` (DeepSpeed's model states; runner_fsdp: ``__0_0.distcp``) goes to
    /dev/full, where every write fails with ENOSPC as on a full disk (checkpoints before it are not affected)."""
    tag_dir = out / "checkpoints" / f"step_{step}"
    tag_dir.mkdir(parents=True)
    (tag_dir / file).symlink_to("/dev/full")


def steps_of(out: Path) -> list[int]:
    return [m["step"] for m in train_steps(out)]
