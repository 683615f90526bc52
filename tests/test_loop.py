"""The shared loop and its hooks, in-process on a single-process test engine (tests/plain_runner.py):
runners/base.py needs no engine, no launcher and no process group."""
from __future__ import annotations

import json

import pytest

import plain_runner  # noqa: F401  (registers runner_plain_test)
from lavis_ds.build import build_runner
from lavis_ds.config import load_config
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import comparable, tiny_config, train_steps, write_yaml

STEPS_PER_EPOCH = 32 // (4 * 2)  # 32 samples, micro 4 x accumulation 2, one process
EPOCHS = 2


@pytest.fixture(scope="module")
def demo_storage(tmp_path_factory):
    storage = tmp_path_factory.mktemp("demo") / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=32, num_val=8, num_test=8))
    return storage


def _runner(tmp_path, demo_storage, name: str, **run):
    cfg = tiny_config(tmp_path / name, demo_storage, accum=2, max_epoch=EPOCHS, save_freq_steps=3,
                      runner="runner_plain_test", valid_splits=["val"], test_splits=["test"], **run)
    cfg["datasets"]["demo_shapes"]["build_info"].update(num_train=32, num_val=8, num_test=8)
    return build_runner(load_config(write_yaml(tmp_path / f"{name}.yaml", cfg)))


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, demo_storage):
    """One uninterrupted run: (its runner, its output_dir); also the crash tests' reference."""
    root = tmp_path_factory.mktemp("loop")
    runner = _runner(root, demo_storage, "plain")
    runner.train()
    return runner, root / "plain"


def test_the_loop_runs_in_process_on_an_engine_of_a_few_lines(plain_run):
    runner, out = plain_run
    steps = train_steps(out)
    assert [m["step"] for m in steps] == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    assert steps[-1]["loss"] < steps[0]["loss"]
    splits = [json.loads(line).get("split") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert splits.count("val") == EPOCHS and splits[-1] == "test"
    marker = json.loads((out / "checkpoints" / f"step_{STEPS_PER_EPOCH * EPOCHS}" / "lavis_ds_complete.json")
                        .read_text())
    assert marker["runner"] == "runner_plain_test" and marker["global_batch"] == 8
    assert json.loads((out / "finished.json").read_text()) == {"global_step": STEPS_PER_EPOCH * EPOCHS}
    assert runner.hooks[0].writer is None  # the logger closed what it opened


@pytest.mark.parametrize("crash_after", [4, STEPS_PER_EPOCH, STEPS_PER_EPOCH + 2])
def test_a_crash_anywhere_resumes_bit_for_bit_and_closes_the_hooks(tmp_path, demo_storage, plain_run, crash_after):
    _, reference_out = plain_run  # the same run uninterrupted
    crashing = _runner(tmp_path, demo_storage, "crashed")
    step = crashing.run_step

    def run_step_then_crash(micro_batches):
        step(micro_batches)
        if crashing.state.global_step == crash_after:
            raise Crash(f"after step {crash_after}")

    crashing.run_step = run_step_then_crash
    with pytest.raises(Crash):
        crashing.train()
    assert crashing.hooks[0].writer is None  # closed in train()'s finally
    assert not (tmp_path / "crashed" / "finished.json").exists()

    _runner(tmp_path, demo_storage, "crashed").train()  # run.resume: auto
    assert comparable(train_steps(tmp_path / "crashed")) == comparable(train_steps(reference_out))
