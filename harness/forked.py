"""Training processes forked from a server that has already imported torch, DeepSpeed and transformers.

On this machine kind, Python start-up is most of a tiny run: importing torch, transformers,
timm and DeepSpeed costs ~9 s of CPU per process, training the tiny model ~3 s. Tests that
need processes which train, save, fail or get killed fork them from multiprocessing's
forkserver, which did those imports once. Each one is still a real process running
``train.py``'s ``main()`` with the variables a launcher sets (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), its own gloo process group and its own DataLoader workers, and it
ends through ``train.py``'s own exit. Other command lines (``export.py``, ``python -m
lavis_ds.apps.generate``, ``tests/placement_worker.py``) are forked the same way: ``target`` names the
``main(argv)`` to run, and the process ends as train.py's does. What only the launchers do (torchrun's agent,
its signal forwarding and failure report, ``python train.py`` starting from nothing) is tested
through the real launchers by the tests that are about them (``harness.processes.command``).
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import wait as wait_for
from pathlib import Path

# What every training process imports, imported once by the server (DeepSpeed and timm first, as a run imports them).
PRELOAD = ["torch", "harness.run_imports", "transformers", "torchvision", "train", "lavis_ds",
           "lavis_ds.runners.deepspeed.engine", "lavis_ds.runners.fsdp.engine",
           "deepspeed.runtime.zero.muon.muon_optimizer", "torch.distributed.checkpoint", "lavis_ds.apps.export",
           "lavis_ds.apps.generate", "harness.forked",
           # imported on first use inside a run: left to each forked job, 13 % of its CPU time (py-spy)
           "peft", "transformers.models.qwen2.modeling_qwen2", "setuptools", "torch.utils.cpp_extension",
           "deepspeed.module_inject.auto_ep_config", "PIL.PngImagePlugin", "torch.utils.tensorboard",
           "harness.frozen"]  # last: after the imports above
TRAIN = "lavis_ds.train:main"  # the default target: what train.py runs
FAILED_PEERS_GRACE = 30  # s: as torchrun, a job whose process failed stops the others after a while
STILL_RUNNING = "forked.Job"  # begins the line a job's stderr gets when it had to stop them

_context = None


def _server():
    """The forkserver context, started with the repository and tests/ importable."""
    global _context
    if _context is None:
        from harness import REPO

        for folder in (str(REPO), str(REPO / "tests")):  # tests/: the targets of the tests (placement_worker, ...)
            if folder not in sys.path:
                sys.path.insert(0, folder)
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def start_server() -> None:
    """Start the server now: it imports PRELOAD in the background (~6 s of one core) until the first job needs it."""
    from multiprocessing import forkserver

    _server()
    forkserver.ensure_running()


def _main(target: str, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str, exit_file: str) -> None:
    """One process of a job: a fresh environment, ``target``'s main(argv) (``module:function``), the scripts' exit,
    its code also written to ``exit_file`` (Job.poll says why)."""
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    os.setsid()  # as start_new_session: a signal to the test's group does not reach it
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # A process the forkserver starts inherits its start method: DataLoader workers (and any other child) would
    # come from a new forkserver of this process, which imports PRELOAD again (~15 s), instead of being forked
    # as in a launched train.py. Back to the interpreter's default.
    multiprocessing.set_start_method(None, force=True)
    import torch
    from lavis_ds.common.dist import exit_now

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    module, function = target.split(":")
    main = getattr(importlib.import_module(module), function)
    sys.argv = [f"{module.replace('.', '/')}.py", *argv]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # what Python does with an uncaught exception
        traceback.print_exc()
        code = 1
    Path(exit_file).write_text(str(code))
    exit_now(code)


class Job:
    """The processes of one launch; quacks like the ``subprocess.Popen`` the tests use.

    ``nodes``: the ``nproc`` processes as that many nodes would run them (``torchrun --nnodes=<nodes>
    --nproc_per_node=<nproc / nodes>`` on each): LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the node) per node.
    """

    def __init__(self, argv: list[str], nproc: int, env: dict, cwd: Path, logs: Path, target: str = TRAIN,
                 nodes: int = 1):
        from run_utils import free_port  # run_utils imports this module

        ctx = _server()
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_file, self.stderr_file = logs / "stdout.txt", logs / "stderr.txt"
        for f in (self.stdout_file, self.stderr_file):
            f.write_text("")
        ranks = max(1, nproc)
        assert ranks % nodes == 0 and (nproc or nodes == 1), (nproc, nodes)
        per_node = ranks // nodes
        launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks),
                    "LOCAL_WORLD_SIZE": str(per_node)} if nproc else {}
        self.processes = []
        # each process writes its exit code here (Job._exit_codes says why); absolute: written after it changed folder
        self.exit_files = [logs.absolute() / f"exit_code.{rank}" for rank in range(ranks)]
        for rank, exit_file in enumerate(self.exit_files):
            rank_env = dict(env, **launcher, **({"RANK": str(rank), "LOCAL_RANK": str(rank % per_node),
                                                 "GROUP_RANK": str(rank // per_node)} if nproc else {}))
            exit_file.unlink(missing_ok=True)
            p = ctx.Process(target=_main, args=(target, argv, rank_env, str(cwd), str(self.stdout_file),
                                                str(self.stderr_file), str(exit_file)))
            p.start()
            self.processes.append(p)
        self.target = target
        self.returncode: int | None = None
        self._first_failure: float | None = None

    @property
    def pid(self) -> int:
        return self.processes[0].pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _exit_codes(self) -> list[int | None]:
        """Each process's exit code; None while it runs. The forkserver relays the code, and under load it sometimes
        loses it, reporting 255 (CPython issue 140867); a process that ended through _main wrote its own code, which
        is then taken instead. One killed by a signal wrote none: the forkserver's -signal stands."""
        codes = []
        for p, exit_file in zip(self.processes, self.exit_files):
            code = p.exitcode
            if code == 255 and exit_file.exists():
                code = int(exit_file.read_text())
            codes.append(code)
        return codes

    def poll(self) -> int | None:
        if self.returncode is None:
            codes = self._exit_codes()
            if any(c not in (None, 0) for c in codes) and None in codes:
                self._first_failure = self._first_failure or time.time()
                if time.time() - self._first_failure > FAILED_PEERS_GRACE:
                    alive = [rank for rank, c in enumerate(codes) if c is None]
                    self.kill()
                    codes = self._exit_codes()
                    with open(self.stderr_file, "a") as f:  # as torchrun reports what it stopped
                        f.write(f"\n{STILL_RUNNING}: rank(s) {alive} still running {FAILED_PEERS_GRACE} s after another "
                                f"process of the job failed (exit codes {codes}): killed\n")
            if None not in codes:
                self.returncode = next((c for c in codes if c != 0), 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.time()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"{self.target} x{len(self.processes)}", timeout)
            wait_for([p.sentinel for p in self.processes if p.exitcode is None], timeout=min(left or 1.0, 1.0))
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """``signum`` to every process of the job (not their DataLoader workers), as torchrun forwards it."""
        for pid in self.pids:
            os.kill(pid, signum)

    def kill(self) -> None:
        """SIGKILL every process of the job and their DataLoader workers at once, as a preemption would."""
        from run_utils import kill_tree

        kill_tree(*self.pids)
        for p in self.processes:
            p.join()

    def output(self) -> tuple[str, str]:
        return self.stdout_file.read_text(errors="replace"), self.stderr_file.read_text(errors="replace")

