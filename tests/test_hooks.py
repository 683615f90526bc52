"""Hooks: `run.hooks` is checked like the rest of the config; the dispatcher's rules; a user's hook from
`imports:` and the three trackers on one real in-process training run (tests/plain_engine.py), read back
with each tracker's own reader (TensorBoard's EventAccumulator, MLflow's client, W&B's run records)."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import plain_engine  # noqa: F401  (registers runner_plain_test)
import wandb_offline
from conftest import demo_storage_fixture
from lavis_ds.build import build_trainer
from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.config import ConfigError, load_config
from lavis_ds.runners.hooks import BUILTIN_HOOKS, Hook, HookList, hook_specs
from run_utils import metrics, tiny_config, write_yaml

STEPS_PER_EPOCH = 32 // (4 * 2)  # 32 samples, micro 4 x accumulation 2, one process
EPOCHS = 2
TOTAL = STEPS_PER_EPOCH * EPOCHS

USER_HOOKS = '''
"""A user's hook, outside lavis_ds: records what reaches it, and asks for a checkpoint at one step."""
from lavis_ds.common.registry import registry
from lavis_ds.runners.hooks import Hook


@registry.register_hook("event_recorder_test")
class EventRecorder(Hook):
    def __init__(self, save_at_step: int = 0, label: str = ""):
        self.save_at_step, self.label, self.events = save_at_step, label, []

    def before_train(self, trainer):
        self.events.append(("before_train", trainer.state.global_step))

    def after_step(self, trainer, metrics):
        self.events.append(("after_step", trainer.state.global_step))
        if trainer.state.global_step == self.save_at_step:
            trainer.request_save(self.label)

    def after_epoch(self, trainer):
        self.events.append(("after_epoch", trainer.state.global_step))

    def log(self, trainer, record):
        self.events.append(("log", record["step"], record.get("split", "train")))

    def after_save(self, trainer, tag_dir):
        self.events.append(("after_save", tag_dir.name))

    def after_train(self, trainer):
        self.events.append(("after_train", trainer.state.global_step))

    def close(self, trainer):
        self.events.append(("close", trainer.state.global_step))
'''


demo_storage = demo_storage_fixture(num_train=32, num_val=8, num_test=8)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """The user's hook module, importable as `imports: [my_hooks_test]`."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "my_hooks_test.py").write_text(textwrap.dedent(USER_HOOKS))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield "my_hooks_test"


def _config(out: Path, demo_storage: Path, hooks: list | None = None, **run) -> dict:
    cfg = tiny_config(out, demo_storage, accum=2, max_epoch=EPOCHS, runner="runner_plain_test",
                      valid_splits=["val"], test_splits=["test"], **run)
    if hooks is not None:
        cfg["run"]["hooks"] = hooks
    return cfg


def _problems(tmp_path: Path, cfg: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path / "bad.yaml", cfg))
    return info.value.problems


# ---- the config ---------------------------------------------------------------------------------------

def test_tensorboard_is_on_by_default_and_a_list_replaces_the_default(tmp_path, demo_storage):
    assert load_config(write_yaml(tmp_path / "a.yaml", _config(tmp_path, demo_storage))).run.hooks == ["tensorboard"]
    cfg = load_config(write_yaml(tmp_path / "b.yaml", _config(tmp_path, demo_storage)),
                      ["run.hooks=[wandb, {name: mlflow, experiment: x}]"])
    assert hook_specs(cfg.run.hooks) == [("wandb", {}), ("mlflow", {"experiment": "x"})]


def test_every_problem_of_run_hooks_is_named_at_load_time(tmp_path, demo_storage):
    problems = _problems(tmp_path, _config(tmp_path, demo_storage, hooks=[
        "mlfow", {"name": "mlflow", "tracking_ur": "file:/x"}, {"name": "wandb", "mode": "sometimes"},
        "validation", {"experiment": "x"}, "tensorboard", "tensorboard", 3]))
    assert problems[0].startswith("run.hooks: expected list[str | dict[str, Any]], got ['mlfow'")  # the 3
    assert problems[1].startswith("run.hooks[0]: Unknown hook 'mlfow'. Did you mean 'mlflow'? Known hooks: "
                                  "best_checkpoint, checkpointer, ")
    assert problems[2:] == [
        "run.hooks[1].tracking_ur: unknown key; did you mean 'tracking_uri'?",
        "run.hooks[2].mode: expected 'online' | 'offline' | 'disabled' | null, got 'sometimes'",
        "run.hooks[3]: 'validation' is a built-in hook and always runs (metrics_log, validation, lmms_eval, "
        "checkpointer, best_checkpoint, test_generation, training_clock, in that order); run.hooks lists the others",
        "run.hooks[4].name: required key is missing; a hook is a registered name or a mapping with `name` and its "
        "options",
        "run.hooks[6]: 'tensorboard' is listed twice",
    ]


@pytest.mark.parametrize("module, package", [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_a_tracker_that_is_not_installed_names_its_pip_package(tmp_path, demo_storage, monkeypatch, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: imports of it fail
    assert _problems(tmp_path, _config(tmp_path, demo_storage, hooks=[module])) == [
        f"run.hooks[0]: the {module!r} hook needs the Python package {module!r}, which is not installed; "
        f"pip install {package} (or pip install 'lavis_ds[trackers]')"]


@pytest.mark.parametrize("name", sorted(hook_registry))
def test_every_registered_hook_builds_with_its_defaults(tmp_path, demo_storage, name):
    hook = hook_registry.get(name)()
    assert isinstance(hook, Hook)
    if name not in BUILTIN_HOOKS:  # and a run may list it with no options
        assert load_config(write_yaml(tmp_path / "ok.yaml", _config(tmp_path, demo_storage, hooks=[name])))


# ---- the dispatcher -----------------------------------------------------------------------------------

class Asking(Hook):
    def __init__(self, event: str, seen: list):
        self.event, self.seen = event, seen

    def after_step(self, trainer, metrics):
        self.seen.append("asking.after_step")
        trainer.hooks.log({"step": 1, "epoch": 0, "loss": 0.5})
        if self.event == "after_step":
            trainer.hooks.request_save("asked")

    def evaluate(self, trainer):
        trainer.hooks.request_save("asked")

    def log(self, trainer, record):
        self.seen.append(f"asking.log {record['loss']}")


class Listening(Hook):
    def __init__(self, seen: list):
        self.seen = seen

    def after_step(self, trainer, metrics):
        self.seen.append("listening.after_step")

    def log(self, trainer, record):
        self.seen.append(f"listening.log {record['loss']}")

    def after_epoch(self, trainer):
        trainer.hooks.call("after_step", {})


def _hook_list(rank: int, *hooks: Hook) -> HookList:
    trainer = SimpleNamespace(rank=rank)
    trainer.hooks = HookList(trainer, list(hooks))
    return trainer.hooks


def test_records_and_save_requests_wait_until_every_hook_saw_the_event():
    seen = []
    hooks = _hook_list(0, Asking("after_step", seen), Listening(seen))
    assert hooks.call("after_step", {}) == ["asked"]
    assert seen == ["asking.after_step", "listening.after_step", "asking.log 0.5", "listening.log 0.5"]
    assert hooks.call("after_step", {}) == ["asked"]  # each dispatch starts afresh


def test_a_save_outside_a_step_event_and_a_nested_dispatch_are_refused():
    hooks = _hook_list(0, Asking("evaluate", []), Listening([]))
    with pytest.raises(RuntimeError, match=r"a checkpoint was requested \(asked\) during evaluate; a hook asks for "
                                           r"one in after_step, after_epoch, on_stop"):
        hooks.call("evaluate")
    with pytest.raises(RuntimeError, match=r"hook event 'after_step' dispatched while 'after_epoch' is"):
        hooks.call("after_epoch")
    assert hooks.call("after_step", {}) == []  # a failed dispatch leaves nothing behind


def test_records_exist_on_rank_0_only():
    seen = []
    _hook_list(1, Asking("none", seen), Listening(seen)).call("after_step", {})
    assert seen == ["asking.after_step", "listening.after_step"]



class NamingItRunner(Hook):
    """A hook written for LAVIS, whose events name the trainer `runner`."""

    def __init__(self, seen: list):
        self.seen = seen

    def after_step(self, runner, metrics):
        self.seen.append(("after_step", runner.rank, metrics))

    def log(self, runner, record):
        self.seen.append(("log", runner.rank, record))


def test_the_trainer_reaches_a_hook_by_position_whatever_the_hook_calls_it():
    seen = []
    hooks = _hook_list(0, NamingItRunner(seen))
    hooks.call("after_step", {"loss": 1.0})
    hooks.log({"step": 1})
    assert seen == [("after_step", 0, {"loss": 1.0}), ("log", 0, {"step": 1})]

# ---- a real run: a user's hook and the trackers ---------------------------------------------------------

TRACKERS = ["tensorboard", {"name": "mlflow", "experiment": "hooks_test"},
            {"name": "wandb", "mode": "offline", "project": "hooks_test"}]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, demo_storage, user_module):
    """One training run with every tracker and the user's hook: (its trainer, its output_dir)."""
    root = tmp_path_factory.mktemp("tracked")
    cfg = _config(root / "out", demo_storage, hooks=[
        *TRACKERS, {"name": "event_recorder_test", "save_at_step": 2, "label": "the user asked"}])
    cfg["imports"] = [user_module]
    trainer = build_trainer(load_config(write_yaml(root / "run.yaml", cfg)))
    trainer.train()
    return trainer, root / "out"


def _expected_numbers(out: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train/loss": [(step, value), ...], "val/loss": ..., "test/exact_match": ...}`` from metrics.jsonl."""
    lines = metrics(out)
    train = [m for m in lines if "split" not in m]
    numbers = {f"train/{key}": [(m["step"], m[key]) for m in train] for key in ("loss", "lr", "grad_norm")}
    numbers["val/loss"] = [(m["step"], m["loss"]) for m in lines if m.get("split") == "val"]
    numbers["test/exact_match"] = [(m["step"], m["exact_match"]) for m in lines if m.get("split") == "test"]
    assert [step for step, _ in numbers["train/loss"]] == list(range(1, TOTAL + 1))
    assert [step for step, _ in numbers["val/loss"]] == [STEPS_PER_EPOCH, TOTAL]
    assert [step for step, _ in numbers["test/exact_match"]] == [TOTAL]
    return numbers


def _mlflow_run(out: Path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told to
    client = MlflowClient((out / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("hooks_test").experiment_id])
    assert len(runs) == 1, "one run; a resumed run continues it"
    return client, runs[0]


def test_mlflow_holds_the_config_and_the_metrics_of_the_run(tracked_run, monkeypatch):
    _, out = tracked_run
    client, run = _mlflow_run(out, monkeypatch)
    for key, expected in _expected_numbers(out).items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == expected, key
    assert run.data.params["run.init_lr"] == "0.001" and run.data.params["model.arch"] == "blip2_qwen"
    assert run.data.params["run.hooks"].startswith('["tensorboard", {"name": "mlflow"')
    assert run.info.status == "FINISHED" and run.info.run_name == "out"


def _wandb_rows(out: Path) -> tuple[str, dict, dict[int, dict]]:
    """(run id, config, {step: every value logged at it}) of each offline run under ``out/wandb``."""
    runs = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        run_id, config = wandb_offline.run_info(path)
        rows: dict[int, dict] = {}
        for row in wandb_offline.history(path):
            rows.setdefault(row["_step"], {}).update(row)
        runs.append((run_id, config, rows))
    return runs


def test_wandb_offline_run_holds_the_config_and_the_metrics_of_the_run(tracked_run):
    _, out = tracked_run
    [(run_id, config, rows)] = _wandb_rows(out)
    for key, expected in _expected_numbers(out).items():
        assert [(step, rows[step][key]) for step, _ in expected] == [(s, pytest.approx(v)) for s, v in expected], key
    assert config["run"]["init_lr"] == 0.001 and config["model"]["arch"] == "blip2_qwen"
    assert json.loads((out / "wandb_run.json").read_text())["id"] == run_id


def test_tensorboard_holds_the_metrics_of_the_run(tracked_run):
    _, out = tracked_run
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    for key, expected in _expected_numbers(out).items():
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(s, pytest.approx(v)) for s, v in expected], key


def test_a_user_hook_from_imports_sees_every_event_in_order_and_its_save_follows_the_event(tracked_run):
    trainer, out = tracked_run
    recorder = trainer.hooks[-1]
    assert [type(hook).__name__ for hook in trainer.hooks] == [
        "MetricsLog", "Validation", "LmmsEval", "Checkpointer", "BestCheckpoint", "TestGeneration", "TrainingClock",
        "TensorBoard", "MLflow", "Wandb", "EventRecorder"]
    assert recorder.label == "the user asked"
    expected = [("before_train", 0)]
    for step in range(1, TOTAL + 1):
        expected += [("after_step", step), ("log", step, "train")]
        if step == 2:  # its own request: cut after its own after_step, the last hook's, and the step's record
            expected.append(("after_save", "step_2"))
        if step % STEPS_PER_EPOCH == 0:  # the epoch end: validated and logged before the checkpoint is cut
            expected += [("after_epoch", step), ("log", step, "val"), ("after_save", f"step_{step}")]
    expected += [("after_train", TOTAL), ("log", TOTAL, "test"), ("close", TOTAL)]
    assert recorder.events == expected
    assert (out / "checkpoints" / "step_2" / "lavis_ds_complete.json").is_file()


class Crash(Exception):
    pass


def test_a_resumed_run_continues_its_mlflow_and_wandb_runs(tmp_path, demo_storage, monkeypatch):
    cfg = write_yaml(tmp_path / "run.yaml", _config(tmp_path / "out", demo_storage, hooks=TRACKERS))
    crashing = build_trainer(load_config(cfg))
    step = crashing.run_step

    def run_step_then_crash(*step_args):
        step(*step_args)
        if crashing.state.global_step == STEPS_PER_EPOCH + 1:
            raise Crash("after the first step past the epoch-end checkpoint")

    crashing.run_step = run_step_then_crash
    with pytest.raises(Crash):
        crashing.train()
    # The crashed process would end here, and W&B's service process with it: the resumed run starts with a service
    # of its own, rather than one still closing the crashed run's stream of the same run id.
    import wandb

    wandb.teardown()
    build_trainer(load_config(cfg)).train()  # run.resume: auto, from the epoch-end checkpoint

    out = tmp_path / "out"
    expected = _expected_numbers(out)  # metrics.jsonl reads like one run
    client, run = _mlflow_run(out, monkeypatch)
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "val/loss"):
        history = client.get_metric_history(run.info.run_id, key)  # the step trained twice is there twice
        assert {m.step: m.value for m in history} == dict(expected[key]), key
    (first_id, _, first), (second_id, _, second) = _wandb_rows(out)  # offline: one folder per process
    assert first_id == second_id
    assert sorted(first) == list(range(1, STEPS_PER_EPOCH + 2)) and sorted(second)[-1] == TOTAL
