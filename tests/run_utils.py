"""Launch real training processes for the tests: train.py alone or under torchrun."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

import forked

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(output_dir: Path, demo_storage: Path, stage: int = 2, dtype: str = "fp32", micro: int = 4,
                accum: int = 1, max_epoch: int = 1, clip: float | None = 1.0, **run) -> dict:
    """A run of the tiny BLIP2-Qwen on a small demo_shapes copy, logging every step. ``stage``: the ZeRO stage;
    ``clip``: run.grad_norm_clip (None: unset); ``run``: more run keys."""
    return {
        "model": {"arch": "blip2_qwen", "model_type": "tiny", "tokenizer": f"{demo_storage}/tokenizer"},
        "datasets": {"demo_shapes": {"build_info": {"storage": str(demo_storage), "num_train": 128,
                                                   "num_val": 16, "num_test": 8}}},
        "run": {
            "output_dir": str(output_dir), "init_lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 2,
            "max_epoch": max_epoch, "log_freq": 1, "seed": 7, "batch_size_eval": 8,
            "batch_size_train": micro, "accum_grad_iters": accum, "precision": dtype,
            **({} if clip is None else {"grad_norm_clip": clip}),
            "deepspeed_config": {"zero_optimization": {"stage": stage}},
            **run,
        },
    }


# The resumption runs: 64 samples, micro 4 x accumulation 2 x 2 processes, 3 epochs, a checkpoint every 3 steps.
STEPS_PER_EPOCH = 64 // (4 * 2 * 2)
EPOCHS = 3
SAVE_EVERY = 3


def noisy_config(out: Path, demo_storage: Path, stage: int, dtype: str, micro: int = 4, accum: int = 2,
                 **run) -> dict:
    """Random crops and flips (the demo's train processor), dropout and stochastic depth all on."""
    cfg = tiny_config(out, demo_storage, stage=stage, dtype=dtype, micro=micro, accum=accum, max_epoch=EPOCHS,
                      save_freq_steps=SAVE_EVERY, **run)
    cfg["datasets"]["demo_shapes"]["build_info"]["num_train"] = 64
    cfg["model"].update(drop_path_rate=0.1, llm_config={"attention_dropout": 0.1},
                        qformer={"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})
    return cfg


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


def complete_steps(out: Path) -> list[str]:
    """Training lines written so far (the file may end in a half-written line)."""
    lines = (out / "metrics.jsonl").read_text().split("\n")[:-1]
    return [line for line in lines if '"split"' not in line]


def comparable(steps: list[dict]) -> list[tuple]:
    return [(m["step"], m["epoch"], m["loss"], m["lr"], m["grad_norm"]) for m in steps]


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


def continue_from(checkpoint: Path, cfg_path: Path, out: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run ``cfg_path`` (whose output_dir is ``out``) on from a copy of another run's ``checkpoint`` (a step_<N>
    folder): a run moved to other settings, processes or engine at that checkpoint."""
    shutil.copytree(checkpoint, Path(out) / "checkpoints" / Path(checkpoint).name)
    return run_train(cfg_path, nproc=nproc)


def assert_same_steps(out: Path, reference_out: Path, steps: range, tolerance: float) -> None:
    """``out`` logged the optimizer ``steps`` and each is the reference run's step of that number: the same lr, the
    loss within ``tolerance`` relative (another engine or number of processes adds in another order)."""
    continued, expected = train_steps(out), {m["step"]: m for m in train_steps(reference_out)}
    assert [m["step"] for m in continued] == list(steps)
    for mine in continued:
        theirs = expected[mine["step"]]
        assert mine["lr"] == theirs["lr"], (mine, theirs)
        assert abs(mine["loss"] - theirs["loss"]) <= tolerance * abs(theirs["loss"]), (mine, theirs)


def write_yaml(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return e


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


def _logs_for(cfg_path: Path) -> Path:
    """A fresh log folder beside the YAML (one per launch: a rerun of the same YAML keeps the first one's)."""
    for i in range(1000):
        folder = cfg_path.parent / f"{cfg_path.stem}.logs{i or ''}"
        if not folder.exists():
            return folder
    raise AssertionError(f"too many runs of {cfg_path}")


def output_of(job: forked.Job) -> str:
    return "\n".join(job.output())


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def train_steps(output_dir: Path) -> list[dict]:
    return [m for m in metrics(output_dir) if "split" not in m]


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


def tracebacks(text: str) -> list[str]:
    """The last line of every Python traceback in ``text``, except torchrun's own report of a failed worker.

    torchrun ends its own run with a traceback (ChildFailedError, SignalException) whenever a
    worker exits non-zero or it was signalled; that is the launcher's, not lavis_ds's.
    """
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            last = lines[j] if j < len(lines) else ""
            if not last.startswith("torch.distributed.elastic."):
                found.append(last)
    return found + (["Original Traceback (a DataLoader worker's)"] if "Original Traceback" in text else [])


def export_matches_logged_val_loss(out: Path, export_dir: Path, storage: Path):
    """Export ``out`` with LoRA and trained rows merged into a plain Hugging Face LLM, and check that it gives the
    validation loss the run logged at its end (demo_shapes ``storage``); returns the loaded export."""
    import pytest
    import torch

    from lavis_ds.apps.export import export_checkpoint, load_exported
    from lavis_ds.apps.generation import as_trained, eval_processors
    from lavis_ds.datasets.instruction import InstructionDataset

    exported = export_checkpoint(out, export_dir, merge_lora=True)
    merged = load_exported(exported)
    vis, text = eval_processors(exported)
    val = InstructionDataset(storage / "annotations" / "val.json", storage / "images", vis, text)
    batch, context = as_trained(merged, val.collater([val[i] for i in range(len(val))]))
    with torch.no_grad(), context:
        result = merged(batch)
    logged = [m for m in metrics(out) if m.get("split") == "val"][-1]
    assert float(result["loss_sum"] / result["num_tokens"]) == pytest.approx(logged["loss"], rel=1e-5)
    return merged
