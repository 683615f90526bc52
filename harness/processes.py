"""Launch real training processes: train.py alone or under torchrun, or forked from the suite's server."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, forked
from harness.checks import comparable, complete_steps, train_steps
from harness.configs import EPOCHS, SAVE_EVERY, STEPS_PER_EPOCH, noisy_config, write_yaml


TRAIN = REPO / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launcher sets for each process: a job gets them from its launcher (torchrun, forked.Job, or train.py's
# single-process defaults), never from the test process, where an in-process run may have set them already.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT")


def env() -> dict:
    e = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return dict(e, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def train_args(cfg_path: Path, options: tuple[str, ...] = ()) -> list[str]:
    return ["--cfg-path", str(cfg_path)] + (["--options", *options] if options else [])


def command(cfg_path: Path, nproc: int = 2, options: tuple[str, ...] = ()) -> list[str]:
    """The command a user types: ``torchrun --nproc_per_node=N train.py ...``, or ``python train.py`` for nproc=0."""
    launcher = [] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                      f"--master_port={free_port()}"]
    return (launcher or [sys.executable]) + [str(TRAIN)] + train_args(cfg_path, options)


def run_train(cfg_path: Path, nproc: int = 2, options: tuple[str, ...] = (), cwd: Path | None = None,
              check: bool = True, timeout: int = 600, launcher: str = "fork") -> subprocess.CompletedProcess:
    """Run train.py with ``nproc`` processes (0: one process without launcher variables, as `python train.py`).

    ``launcher="fork"`` forks the processes from a server that imported torch & co once (``forked``);
    ``"launch"`` runs the user's command (``torchrun ...`` or ``python train.py``), for the tests about it.
    """
    if launcher == "fork":
        proc = run_forked(forked.TRAIN, train_args(cfg_path, options), _logs_for(cfg_path), nproc, cwd, timeout)
    else:
        proc = subprocess.run(command(cfg_path, nproc, options), cwd=cwd or REPO, env=env(), capture_output=True,
                              text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_forked(target: str, argv: list[str], logs: Path, nproc: int = 0, cwd: Path | None = None,
               timeout: int = 600) -> subprocess.CompletedProcess:
    """``target``'s ``main(argv)`` (``module:function``) in ``nproc`` processes forked from the suite's server (0: one,
    without launcher variables), as its script runs it; ``logs``: a new folder for the output."""
    job = forked.Job(argv, nproc, env(), cwd or REPO, logs, target)
    try:
        code = job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    stdout, stderr = job.output()
    return subprocess.CompletedProcess([f"{target}(forked)", f"x{max(1, nproc)}", *argv], code, stdout, stderr)


def run_together(*commands: list[str], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Independent commands started at once, as ``subprocess.run(cmd, capture_output=True, text=True)`` each: a
    launch is mostly one process importing torch & co on one core, so two of them take one wall-clock wait."""
    running = [subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for cmd in commands]
    done = []
    for cmd, proc in zip(commands, running):
        stdout, stderr = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    return done


def start(cfg_path: Path, nproc: int = 2, launcher: str = "fork", nodes: int = 1):
    """A training job left running (``launcher`` as for ``run_train``; a forked one on ``nodes`` simulated nodes,
    see ``forked.Job``); ``output_of`` reads a forked job's output."""
    if launcher == "fork":
        return forked.Job(train_args(cfg_path), nproc, env(), REPO, _logs_for(cfg_path), nodes=nodes)
    assert nodes == 1, "a launched job on several nodes: see test_multinode.two_nodes"
    return subprocess.Popen(command(cfg_path, nproc), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def kill_after_step(proc, out: Path, step: int, timeout: float = 300) -> None:
    """SIGKILL the whole job as soon as ``step`` is in metrics.jsonl."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").is_file() and len(complete_steps(out)) >= step:
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}"
    kill(proc)


def kill(proc) -> None:
    """SIGKILL a job, forked or launched, with every process under it."""
    if isinstance(proc, forked.Job):
        proc.kill()
    else:
        kill_tree(proc.pid)
        proc.wait()


def kill_tree(*pids: int) -> None:
    """SIGKILL launchers (or a forked job's processes) and every process under them at once, as a preemption would.

    torchrun starts each worker in its own session, so killing the launcher's
    process group would leave the workers running.
    """
    import psutil  # a DeepSpeed dependency

    tree = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree += root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:  # a process of the job that had ended already
            pass
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # freeze all first: none runs on after another died
        for process in tree:
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, f"still running after SIGKILL: {alive}"


def _logs_for(cfg_path: Path) -> Path:
    """A fresh log folder beside the YAML (one per launch: a rerun of the same YAML keeps the first one's)."""
    for i in range(1000):
        folder = cfg_path.parent / f"{cfg_path.stem}.logs{i or ''}"
        if not folder.exists():
            return folder
    raise AssertionError(f"too many runs of {cfg_path}")


def output_of(job: forked.Job) -> str:
    return "\n".join(job.output())


def continue_from(checkpoint: Path, cfg_path: Path, out: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run ``cfg_path`` (whose output_dir is ``out``) on from a copy of another run's ``checkpoint`` (a step_<N>
    folder): a run moved to other settings, processes or engine at that checkpoint."""
    shutil.copytree(checkpoint, Path(out) / "checkpoints" / Path(checkpoint).name)
    return run_train(cfg_path, nproc=nproc)


def killed_run_continues_bit_for_bit(tmp_path: Path, demo_storage: Path, stage: int, dtype: str,
                                     steps_per_epoch: int = STEPS_PER_EPOCH, **run) -> list[tuple]:
    """A noisy run SIGKILLed after a random step (anywhere after the first checkpoint, checkpoint steps and
    epoch ends included) and rerun, against the same run uninterrupted: asserts the rerun resumed and that
    both curves are identical; returns the curve. ``run``: run keys, and ``micro``/``accum`` of ``noisy_config``."""
    reference_out, killed_out = tmp_path / "reference", tmp_path / "killed"
    reference = write_yaml(tmp_path / "reference.yaml", noisy_config(reference_out, demo_storage, stage, dtype, **run))
    killed = write_yaml(tmp_path / "killed.yaml", noisy_config(killed_out, demo_storage, stage, dtype, **run))
    total = steps_per_epoch * EPOCHS
    kill_step = random.randint(SAVE_EVERY + 1, total - 2)

    # The reference runs next to the run that gets killed: two jobs, one wall-clock wait.
    reference_job = start(reference)
    kill_after_step(start(killed), killed_out, kill_step)
    rerun = run_train(killed)
    assert reference_job.wait(timeout=600) == 0, output_of(reference_job)[-4000:]

    expected = comparable(train_steps(reference_out))
    assert len(expected) == total
    assert "resumed from" in rerun.stdout, f"kill after step {kill_step}: no resume\n{rerun.stdout[-2000:]}"
    assert comparable(train_steps(killed_out)) == expected, f"killed after step {kill_step}"
    return expected
