"""Two nodes, simulated on this machine: two `torchrun --nnodes=2 --nproc_per_node=1` launches meeting at a c10d
rendezvous on 127.0.0.1. They train, get killed together, resume bit for bit; the checkpoint also resumes on
one node. (The uninterrupted runs they are compared with are forked, tests/forked.py.)"""
from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import demo_storage_fixture
from run_utils import (EPOCHS, REPO, SAVE_EVERY, STEPS_PER_EPOCH, TRAIN, comparable, env, free_port, kill_after_step,
                       kill_tree, noisy_config, output_of, run_train, start, tracebacks, train_steps, write_yaml)


demo_storage = demo_storage_fixture(num_train=64, num_val=16, num_test=8)


def two_nodes(cfg_path, log, node_env=({}, {})) -> list[subprocess.Popen]:
    """Node 0 and node 1 of one job, each a torchrun with one process, as on two machines (``log``: one file for
    both or one per node; ``node_env``: each node's own environment variables)."""
    logs = log if isinstance(log, (list, tuple)) else (log, log)
    endpoint, job = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    return [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", str(TRAIN), "--cfg-path",
         str(cfg_path)], cwd=REPO, env=dict(env(), **node_env[node]), stdout=logs[node], stderr=logs[node],
        start_new_session=True)
        for node in (0, 1)]


def wait_all(nodes, log_path) -> None:
    codes = [node.wait(timeout=600) for node in nodes]
    assert codes == [0, 0], log_path.read_text()[-5000:]


def test_two_nodes_killed_together_resume_bit_for_bit_and_on_one_node(tmp_path, demo_storage):
    total = STEPS_PER_EPOCH * EPOCHS
    runs = {name: tmp_path / name for name in ("reference", "killed", "one_node")}
    cfgs = {name: write_yaml(tmp_path / f"{name}.yaml", noisy_config(out, demo_storage, 2, "fp32"))
            for name, out in runs.items()}

    kill_step = random.randint(SAVE_EVERY + 1, total - 2)
    # The reference job runs beside the one that gets killed: two jobs, one wall-clock wait. It is the same job
    # uninterrupted, its two processes forked from the suite's server with the variables torchrun gives them on two
    # nodes (tests/forked.py): the launches under test are the killed job's and its rerun's.
    reference_job = start(cfgs["reference"], nproc=2, nodes=2)
    with open(tmp_path / "killed.log", "w") as log:
        nodes = two_nodes(cfgs["killed"], log)
        kill_after_step(nodes[0], runs["killed"], kill_step)
        kill_tree(nodes[1].pid)  # the whole job goes down, as when its nodes are preempted
        nodes[1].wait()
        wait_all(two_nodes(cfgs["killed"], log), tmp_path / "killed.log")
    assert reference_job.wait(timeout=600) == 0, output_of(reference_job)[-4000:]
    reference = comparable(train_steps(runs["reference"]))
    assert len(reference) == total
    # Output is written once per job: rank 0 of node 0, not a rank 0 of each node.
    assert len([line for line in (runs["reference"] / "metrics.jsonl").read_text().splitlines()
                if '"split"' not in line]) == total
    log_text = (tmp_path / "killed.log").read_text()
    assert "resumed from" in log_text, log_text[-3000:]
    assert comparable(train_steps(runs["killed"])) == reference, f"killed after step {kill_step}"

    # The two-node job's epoch-1 checkpoint (written by the torchrun nodes, before or after the kill), continued by 2
    # processes on one node.
    saved = f"checkpoints/step_{STEPS_PER_EPOCH}"
    shutil.copytree(runs["killed"] / saved, runs["one_node"] / saved)
    proc = run_train(cfgs["one_node"])
    assert f"resumed from {runs['one_node'] / saved}" in proc.stdout
    continued = train_steps(runs["one_node"])
    assert [m["step"] for m in continued] == list(range(STEPS_PER_EPOCH + 1, total + 1))
    for mine, theirs in zip(continued, train_steps(runs["reference"])[STEPS_PER_EPOCH:]):
        # Same ranks, same data; reductions across "nodes" may add in another order.
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * abs(theirs["loss"]), (mine, theirs)


def test_an_output_dir_that_one_node_cannot_see_is_named_before_anything_is_written(tmp_path, demo_storage):
    """A node-local output_dir (here each node's own $NODE_SCRATCH, as $TMPDIR is on clusters): the job stops at
    start with the ranks and hosts that do not see rank 0's files, instead of writing half checkpoints."""
    cfg = noisy_config(tmp_path / "unused", demo_storage, 2, "fp32")
    cfg["run"]["output_dir"] = "${oc.env:NODE_SCRATCH}/run"
    scratch = [tmp_path / "node0", tmp_path / "node1"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]  # one each: the two launchers' reports would interleave
    with open(logs[0], "w") as log0, open(logs[1], "w") as log1:
        nodes = two_nodes(write_yaml(tmp_path / "run.yaml", cfg), (log0, log1),
                          node_env=[{"NODE_SCRATCH": str(s)} for s in scratch])
        codes = [node.wait(timeout=600) for node in nodes]
    text = logs[0].read_text() + logs[1].read_text()
    assert codes == [1, 1], text[-4000:]  # torchrun's code for a failed worker; ours (2) is in its report
    assert re.search(rf"run\.output_dir: {scratch[0]}/run is not one folder shared by every process: rank 1 "
                     r"\(host [^,]+, node 1\) does not see the file rank 0", text), text[-4000:]
    assert not tracebacks(text), text[-4000:]
    assert not (scratch[0] / "run" / "checkpoints").exists() and not (scratch[1] / "run").exists()


def test_the_deepspeed_launcher_without_ssh_runs_two_nodes_as_the_forked_job_does(tmp_path, demo_storage):
    """`deepspeed --hostfile H --no_ssh --node_rank i` on each node (no ssh, no pdsh), as docs/multinode.md says: one
    job of two nodes, written once, taking the steps a 2-process job on one node takes."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")  # names only: without ssh nobody connects to them
    runs = {name: tmp_path / name for name in ("two_nodes", "one_node")}
    cfgs = {}
    for name, out in runs.items():
        cfg = noisy_config(out, demo_storage, 2, "fp32")
        cfg["run"]["max_epoch"] = 1
        cfgs[name] = write_yaml(tmp_path / f"{name}.yaml", cfg)
    port = free_port()
    one_node = start(cfgs["one_node"])  # forked, beside the launched job: one wall-clock wait
    with open(tmp_path / "job.log", "w") as log:
        nodes = [subprocess.Popen(
            [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
             f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", str(TRAIN), "--cfg-path",
             str(cfgs["two_nodes"])], cwd=REPO, env=env(), stdout=log, stderr=log, start_new_session=True)
            for node in (0, 1)]
        wait_all(nodes, tmp_path / "job.log")
    assert one_node.wait(timeout=600) == 0, output_of(one_node)[-4000:]
    two_nodes = comparable(train_steps(runs["two_nodes"]))
    assert len(two_nodes) == STEPS_PER_EPOCH  # one metrics line per step: rank 0 of the job writes it
    for mine, theirs in zip(two_nodes, comparable(train_steps(runs["one_node"]))):
        assert mine[:2] == theirs[:2] and abs(mine[2] - theirs[2]) <= 1e-5 * abs(theirs[2]), (mine, theirs)
