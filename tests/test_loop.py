"""The shared loop and its hooks, in-process on a single-process test engine (tests/plain_engine.py):
the trainer (runners/trainer.py) needs no real engine, no launcher and no process group."""
from __future__ import annotations

import json
import shutil

import pytest

import plain_engine  # noqa: F401  (registers runner_plain_test)
from conftest import demo_storage_fixture
from lavis_ds.build import build_trainer
from lavis_ds.config import load_config
from lavis_ds.runners import checkpoint as ckpt
from run_utils import comparable, tiny_config, train_steps, write_yaml

STEPS_PER_EPOCH = 32 // (4 * 2)  # 32 samples, micro 4 x accumulation 2, one process
EPOCHS = 2


demo_storage = demo_storage_fixture(num_train=32, num_val=8, num_test=8)


def _trainer(tmp_path, demo_storage, name: str, **run):
    cfg = tiny_config(tmp_path / name, demo_storage, accum=2, max_epoch=EPOCHS, save_freq_steps=3,
                      runner="runner_plain_test", valid_splits=["val"], test_splits=["test"], **run)
    return build_trainer(load_config(write_yaml(tmp_path / f"{name}.yaml", cfg)))


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, demo_storage):
    """One uninterrupted run: (its trainer, its output_dir); also the crash tests' reference."""
    root = tmp_path_factory.mktemp("loop")
    trainer = _trainer(root, demo_storage, "plain")
    trainer.train()
    return trainer, root / "plain"


def test_the_loop_runs_in_process_on_an_engine_of_a_few_lines(plain_run):
    trainer, out = plain_run
    steps = train_steps(out)
    assert [m["step"] for m in steps] == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    assert steps[-1]["loss"] < steps[0]["loss"]
    splits = [json.loads(line).get("split") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert splits.count("val") == EPOCHS and splits[-1] == "test"
    marker = json.loads((out / "checkpoints" / f"step_{STEPS_PER_EPOCH * EPOCHS}" / "lavis_ds_complete.json")
                        .read_text())
    assert marker["runner"] == "runner_plain_test" and marker["global_batch"] == 8
    assert json.loads((out / "finished.json").read_text()) == {"global_step": STEPS_PER_EPOCH * EPOCHS}
    assert trainer.hooks[0].writer is None  # the logger closed what it opened


@pytest.mark.parametrize("crash_after", [4, STEPS_PER_EPOCH, STEPS_PER_EPOCH + 2])
def test_a_crash_anywhere_resumes_bit_for_bit_and_closes_the_hooks(tmp_path, demo_storage, plain_run, crash_after):
    _, reference_out = plain_run  # the same run uninterrupted
    crashing = _trainer(tmp_path, demo_storage, "crashed")
    step = crashing.run_step

    def run_step_then_crash(*step_args):
        step(*step_args)
        if crashing.state.global_step == crash_after:
            raise Crash(f"after step {crash_after}")

    crashing.run_step = run_step_then_crash
    with pytest.raises(Crash):
        crashing.train()
    assert crashing.hooks[0].writer is None  # closed in train()'s finally
    assert not (tmp_path / "crashed" / "finished.json").exists()

    _trainer(tmp_path, demo_storage, "crashed").train()  # run.resume: auto
    assert comparable(train_steps(tmp_path / "crashed")) == comparable(train_steps(reference_out))


def test_a_step_makes_one_collective_and_the_next_steps_agreement_rides_on_it(tmp_path, demo_storage, plain_run,
                                                                             monkeypatch):
    """Within an epoch the next step's agreement (stop signals, failures, its supervised tokens) rides on this
    step's loss check: one all-reduce per step; an epoch's first step agrees alone. The curve is the same."""
    from lavis_ds.common import comm

    calls, per_step = [], []
    # every all-reduce starts here, collected at once (comm.all_reduce) or later (the loss check)
    monkeypatch.setattr(comm, "start_all_reduce",
                        lambda *a, _start=comm.start_all_reduce, **k: calls.append(1) or _start(*a, **k))
    trainer = _trainer(tmp_path, demo_storage, "counted")
    step = trainer.run_step

    def counted_step(*step_args):
        calls.clear()
        step(*step_args)
        per_step.append(len(calls))

    def uncounted_save():  # a checkpoint's own agreements (every 3rd step here) are not the step's
        before = len(calls)
        saved = save()
        del calls[before:]
        return saved

    trainer.run_step, save, trainer.save = counted_step, trainer.save, uncounted_save
    trainer.train()
    assert per_step == ([2] + [1] * (STEPS_PER_EPOCH - 1)) * EPOCHS
    assert comparable(train_steps(tmp_path / "counted")) == comparable(train_steps(plain_run[1]))


def test_building_a_trainer_reads_no_checkpoint_and_calls_no_collective(tmp_path, demo_storage, plain_run,
                                                                        monkeypatch):
    """The constructor only assigns; setup() (train's first step) chooses the checkpoint and sets a damaged one aside."""
    from lavis_ds.common import comm

    _, reference_out = plain_run
    shutil.copytree(reference_out, tmp_path / "copy")
    checkpoints = tmp_path / "copy" / "checkpoints"
    newest = checkpoints / f"step_{STEPS_PER_EPOCH * EPOCHS}"
    state_file = newest / plain_engine.STATE_FILE
    state_file.write_bytes(state_file.read_bytes()[:100])  # truncated: a damaged checkpoint
    for name in ("all_reduce", "all_gather_object", "barrier", "broadcast_object"):
        monkeypatch.setattr(comm, name, _no_collective(name))

    trainer = _trainer(tmp_path, demo_storage, "copy")  # run.resume: auto
    assert newest.is_dir() and trainer.plan is None and len(trainer.hooks) == 0

    monkeypatch.undo()
    trainer.setup()
    assert not newest.exists() and (checkpoints / f"{newest.name}{ckpt.DAMAGED_SUFFIX}").is_dir()
    assert trainer.plan.source == (checkpoints, "step_6")
    trainer.setup()  # once: nothing more is set aside, nothing is rebuilt
    assert trainer.plan.source == (checkpoints, "step_6")


def _no_collective(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"comm.{name} called while building a trainer")
    return refuse


def test_a_hook_failing_to_set_up_still_closes_the_others(tmp_path, demo_storage):
    trainer = _trainer(tmp_path, demo_storage, "failing_hook")
    trainer.setup()

    def fail(_trainer):
        raise Crash("before_train")

    trainer.hooks[1].before_train = fail  # after the logger opened its writer
    with pytest.raises(Crash):
        trainer.train()
    assert trainer.hooks[0].writer is None
