"""Every control path under a process group that refuses CPU tensors as NCCL does.

``LAVIS_DS_NCCL_STANDIN=1`` starts the default group as gloo bound to ``cuda`` only: on this CPU
machine any collective on a CPU tensor there fails with NCCL's own error ("No backend type
associated with device type cpu"). lavis_ds's control traffic goes over its control group
(``common/comm.py``), so the loop must run whole. The engines' data plane cannot run under it
here (their tensors are CPU tensors too), so the runs use ``runner_control_test``
(tests/control_engine.py): the real loop, hooks, evaluation, checkpoints and resumption on 2
processes that exchange no data. DeepSpeed and FSDP on a real NCCL group are tests/gpu's.
"""
from __future__ import annotations

import ast
import json
import os
import signal
import time
from pathlib import Path

import pytest

import forked
from conftest import demo_storage_fixture
from lavis_ds.common.comm import STANDIN_ENV
from lavis_ds.runners.checkpoint import complete_checkpoints
from run_utils import REPO, env, metrics, tiny_config, train_args, train_steps, write_yaml

STEPS = 8  # 32 samples, micro 4, 2 processes: 4 optimizer steps an epoch, 2 epochs

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
               "isend", "irecv", "all_to_all", "all_to_all_single", "new_group", "init_process_group"}


def _distributed_calls(path: Path) -> list[str]:
    """``<line>: <call>`` for every torch.distributed / deepspeed.comm collective called in ``path``."""
    tree = ast.parse(path.read_text())
    aliases, direct = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name in ("torch.distributed", "deepspeed.comm")}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed", "deepspeed.comm"):
            direct |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "deepspeed"):
            aliases |= {a.asname or a.name for a in node.names if a.name in ("distributed", "comm")}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and ast.unparse(f.value) in aliases | {
                "torch.distributed", "deepspeed.comm"}:
            found.append(f"{node.lineno}: {ast.unparse(f)}")
        elif isinstance(f, ast.Name) and f.id in direct:
            found.append(f"{node.lineno}: {f.id}")
    return found


def test_no_collective_outside_the_comm_module():
    sources = [*sorted((REPO / "lavis_ds").rglob("*.py")), REPO / "train.py", REPO / "export.py"]
    offenders = {str(p.relative_to(REPO)): calls for p in sources
                 if p != REPO / "lavis_ds/common/comm.py" and (calls := _distributed_calls(p))}
    assert offenders == {}
    assert len(_distributed_calls(REPO / "lavis_ds/common/comm.py")) >= 5  # the scan sees calls where they are


demo_storage = demo_storage_fixture(num_train=32, num_val=8, num_test=8)


def _project(folder: Path, demo_storage: Path, **run) -> Path:
    cfg = tiny_config(folder / "out", demo_storage, max_epoch=2, runner="runner_control_test", valid_splits=["val"],
                      test_splits=["test"], val_metrics=["exact_match"], save_freq_steps=3, keep_last=2,
                      best_metric="val/loss", **run)
    cfg["imports"] = ["control_engine"]
    return write_yaml(folder / "run.yaml", cfg)


def _standin_env(**extra) -> dict:
    return dict(env(), **{STANDIN_ENV: "1"}, **extra)


def _train(cfg: Path, logs: Path, options: tuple[str, ...] = (), **extra):
    job = forked.Job(train_args(cfg, options), 2, _standin_env(**extra), REPO, logs)
    code = job.wait(300)
    return code, *job.output()


def _saved(out: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(out / "checkpoints")]


def test_the_loop_evaluation_checkpoints_and_resumption_run_whole(tmp_path, demo_storage):
    cfg = _project(tmp_path, demo_storage)
    out = tmp_path / "out"
    code, stdout, stderr = _train(cfg, tmp_path / "logs1")
    assert code == 0, stderr[-4000:]
    assert "No backend type" not in stderr
    assert [m["step"] for m in train_steps(out)] == list(range(1, STEPS + 1))  # losses reduced every step
    records = metrics(out)
    val = [r for r in records if r.get("split") == "val"]
    assert len(val) == 2 and all(r["loss"] > 0 and r["num_tokens"] > 0 and "exact_match" in r for r in val)
    test = [r for r in records if r.get("split") == "test"]
    assert len(test) == 1 and len(test[0]["samples"]) == 5  # predictions gathered from both processes
    kept = _saved(out)
    assert f"step_{STEPS}" in kept and len(kept) <= 3  # keep_last=2 plus the best by val/loss
    # Rerun: the start-up checks read every checkpoint on both processes and agree; the run is finished.
    code, stdout, stderr = _train(cfg, tmp_path / "logs2")
    assert code == 0 and "already finished" in stdout, stderr[-3000:]
    # Resume an explicit middle checkpoint into a new folder: the loaded state continues to the end.
    middle = min(kept, key=lambda name: int(name.split('_')[1]))
    code, stdout, stderr = _train(cfg, tmp_path / "logs3", (f"run.resume={out / 'checkpoints' / middle}",
                                                            f"run.output_dir={tmp_path / 'again'}"))
    assert code == 0 and "resumed from" in stdout, stderr[-3000:]
    assert train_steps(tmp_path / "again")[-1]["step"] == STEPS


def test_sigterm_stops_every_process_at_one_step_with_a_checkpoint(tmp_path, demo_storage):
    cfg = _project(tmp_path, demo_storage)
    out = tmp_path / "out"
    job = forked.Job(train_args(cfg), 2, _standin_env(), REPO, tmp_path / "logs")
    deadline = time.time() + 240
    while not (out / "metrics.jsonl").is_file() or not any(m.get("step") == 2 for m in train_steps(out)):
        assert time.time() < deadline and job.poll() is None, job.output()[1][-3000:]
        time.sleep(0.2)
    for pid in job.pids:
        os.kill(pid, signal.SIGTERM)
    assert job.wait(120) == 128 + signal.SIGTERM, job.output()[1][-3000:]
    stopped_at = train_steps(out)[-1]["step"]
    assert f"step_{stopped_at}" in _saved(out)  # saved by both processes on the agreed step
    code, stdout, stderr = _train(cfg, tmp_path / "logs2")
    assert code == 0 and train_steps(out)[-1]["step"] == STEPS, stderr[-3000:]


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_a_nonfinite_loss_on_one_process_is_agreed_by_all(tmp_path, demo_storage, on_nonfinite):
    cfg = _project(tmp_path, demo_storage, on_nonfinite=on_nonfinite)
    code, stdout, stderr = _train(cfg, tmp_path / "logs", CONTROL_NAN_AT="3:1")
    steps = train_steps(tmp_path / "out")
    assert stderr.count("non-finite loss at optimizer step 3") == 1 and "rank 1, micro-batch 1 of 1: nan" in stderr
    if on_nonfinite == "stop":
        assert code == 1 and [m["step"] for m in steps] == [1, 2]
    else:
        assert code == 0, stderr[-3000:]
        assert steps[2]["skipped"] == "nonfinite_loss" and steps[-1]["step"] == STEPS


def test_the_other_control_paths_one_by_one(tmp_path):
    job = forked.Job([str(tmp_path / "shared")], 2, _standin_env(), REPO, tmp_path / "logs",
                     target="standin_worker:main")
    assert job.wait(120) == 0, job.output()[1][-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / "shared" / f"rank{rank}.json").read_text())
        assert got["default_group_refuses_cpu"] is True  # the stand-in is in force
        assert got["stop"] == 15
        assert got.get("own_error" if rank == 1 else "peer_failed") is not None
        assert got["built_on_rank0"] is True and got["built_on_rank0_whole"] is False
        assert got["shared_folder_error"] == ""
        assert got["any_failed"] is True and got["none_failed"] is False
