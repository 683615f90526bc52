"""`run.lmms_eval` and a `run.best_metric` on its scores, checked with the config: one `lavis_ds:` line per mistake,
against lmms-eval's real task index (its shipped `pope` and `mme` tasks: their YAMLs are read, no data; the demo's
offline tasks; a task of the user's whose data file is missing)."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from conftest import demo_storage_fixture
from lavis_ds.config import ConfigError, load_config
from run_utils import REPO, tiny_config, write_yaml

demo_storage = demo_storage_fixture(num_train=16, num_val=8, num_test=8)

DEMO_TASKS = REPO / "projects" / "demo" / "lmms_eval"
POPE_SCORES = ("lmms_eval/pope/pope_accuracy, lmms_eval/pope/pope_precision, lmms_eval/pope/pope_recall, "
               "lmms_eval/pope/pope_f1_score, lmms_eval/pope/pope_yes_ratio")


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """Datasets may be downloaded (pope's and mme's are hub datasets): the offline check is its own test's."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def _load(tmp_path, demo_storage, **run):
    return load_config(write_yaml(tmp_path / "run.yaml", tiny_config(tmp_path / "out", demo_storage, **run)))


def test_a_benchmark_score_as_best_metric_is_accepted(tmp_path, demo_storage):
    cfg = _load(tmp_path, demo_storage, lmms_eval={"tasks": ["pope", "mme"], "every": 2, "limit": 4},
                best_metric="lmms_eval/mme/mme_perception_score")
    assert cfg.run.lmms_eval.tasks == ["pope", "mme"] and cfg.run.best_metric == "lmms_eval/mme/mme_perception_score"


@pytest.mark.parametrize("run, problem", [
    ({"lmms_eval": {"tasks": ["pope"]}, "best_metric": "lmms_eval/pope/accuracy"},
     f"run.best_metric: 'lmms_eval/pope/accuracy' is not a score of the tasks of run.lmms_eval; choose one of: "
     f"{POPE_SCORES}"),
    ({"best_metric": "lmms_eval/pope/pope_accuracy"},
     "run.best_metric: 'lmms_eval/pope/pope_accuracy' names an lmms-eval score, and run.lmms_eval is not set; set "
     "run.lmms_eval: {tasks: [...]} or choose a validation metric"),
    ({"lmms_eval": {"tasks": ["popee"]}},
     "run.lmms_eval.tasks[0]: 'popee' is not an lmms-eval task or group; did you mean 'pope', 'pope_pop', "
     "'pope_adv'? (a task of your own: set run.lmms_eval.include_path)"),
    ({"lmms_eval": {"tasks": ["pope"], "every": 0}},
     "run.lmms_eval.every: expected a number of optimizer steps (>= 1) or 'epoch', got 0"),
    ({"lmms_eval": {"tasks": ["pope"], "every": "epochs"}},
     "run.lmms_eval.every: expected int | 'epoch', got 'epochs'"),
    ({"lmms_eval": {"tasks": ["pope"], "limt": 3}}, "run.lmms_eval.limt: unknown key; did you mean 'limit'?"),
    ({"lmms_eval": {"tasks": []}},
     "run.lmms_eval.tasks: no task named; list lmms-eval task names, e.g. [mmbench_en_dev]"),
    ({"lmms_eval": {"every": 2}}, "run.lmms_eval.tasks: required key is missing"),
    ({"lmms_eval": {"tasks": ["pope"], "include_path": "/nonexistent/tasks"}},
     "run.lmms_eval.include_path: folder '/nonexistent/tasks' does not exist (it holds task YAMLs)"),
    ({"lmms_eval": {"tasks": ["pope"], "on_error": "ignore"}},
     "run.lmms_eval.on_error: expected 'stop' | 'continue', got 'ignore'"),
], ids=["best-metric-not-a-score", "best-metric-without-lmms-eval", "unknown-task", "every-zero", "every-word",
        "unknown-key", "no-task", "tasks-missing", "include-path-missing", "on-error-word"])
def test_a_bad_lmms_eval_setting_is_one_line(tmp_path, demo_storage, run, problem):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, demo_storage, **run)
    assert info.value.problems == [problem]


def test_the_demo_tasks_and_their_scores_are_accepted(tmp_path, demo_storage):
    cfg = _load(tmp_path, demo_storage, best_metric="lmms_eval/demo_shapes_colour/acc",
                lmms_eval={"tasks": ["demo_shapes_caption", "demo_shapes_colour"], "include_path": str(DEMO_TASKS)})
    assert cfg.run.best_metric == "lmms_eval/demo_shapes_colour/acc"


def test_a_task_whose_local_dataset_is_not_on_disk_is_refused_before_training(tmp_path, demo_storage):
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "local_vqa.yaml").write_text(LOCAL_TASK)
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, demo_storage, lmms_eval={"tasks": ["local_vqa"], "include_path": str(folder)})
    assert info.value.problems == [
        f"run.lmms_eval.tasks: task local_vqa ({folder / 'local_vqa.yaml'}): dataset file vqa.json is not on disk (dataset_kwargs.data_files; a relative path is read beside the task's YAML file): copy the "
        "dataset there or point data_files at it"]


@pytest.mark.parametrize("offline, cached", [("HF_DATASETS_OFFLINE", False), ("HF_HUB_OFFLINE", False),
                                             ("HF_HUB_OFFLINE", True), (None, False)],
                         ids=["datasets-offline", "hub-offline", "offline-cached", "online"])
def test_an_offline_hub_dataset_that_is_not_cached_is_refused_before_training(tmp_path, demo_storage, monkeypatch,
                                                                              offline, cached):
    """Offline, a hub dataset is read from the datasets cache alone; one missing there would cost lmms-eval's
    retries (up to a minute) at the first evaluation. Cached (laid out as datasets lays out a hub dataset's copy:
    <namespace>___<name>/<config>/<version>/<fingerprint>), or online, it is accepted."""
    if offline:
        monkeypatch.setenv(offline, "1")
    cache, folder = tmp_path / "datasets_cache", tmp_path / "tasks"
    folder.mkdir()
    if cached:
        (cache / "lavis-ds-tests___shapes_vqa" / "default" / "0.0.0" / "0123abcd").mkdir(parents=True)
    (folder / "hub_vqa.yaml").write_text(LOCAL_TASK.replace("local_vqa", "hub_vqa").replace(
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: vqa.json\n",
        f"dataset_path: lavis-ds-tests/ShapesVQA\ndataset_kwargs:\n  cache_dir: {cache}\n"))
    settings = {"tasks": ["hub_vqa"], "include_path": str(folder)}
    if cached or not offline:
        assert _load(tmp_path, demo_storage, lmms_eval=settings).run.lmms_eval.tasks == ["hub_vqa"]
        return
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, demo_storage, lmms_eval=settings)
    assert info.value.problems == [(
        f"run.lmms_eval.tasks: task hub_vqa ({folder / 'hub_vqa.yaml'}): dataset lavis-ds-tests/ShapesVQA "
        f"(dataset_path, a Hugging Face hub dataset) is not in the datasets cache {cache}, and {offline}=1 forbids "
        "downloading it: load the task once where there is a network (into the same cache), or point the task at a "
        "local copy (docs/evaluation.md)")]


LOCAL_TASK = """task: local_vqa
dataset_path: json
dataset_kwargs:
  data_files:
    test: vqa.json
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def test_lmms_eval_not_installed_names_the_install_command(tmp_path, demo_storage, monkeypatch):
    monkeypatch.setitem(sys.modules, "lmms_eval", None)  # as if not installed: imports of it fail
    with pytest.raises(ConfigError, match=r"run\.lmms_eval: evaluating on lmms-eval tasks needs lmms-eval, which is "
                                          r"not installed; pip install -e \"\.\[eval\]\"") as info:
        _load(tmp_path, demo_storage, lmms_eval={"tasks": ["pope"]})
    assert len(info.value.problems) == 1


def test_the_best_checkpoint_follows_the_direction_the_lmms_eval_record_gives(tmp_path):
    """lavis_ds knows no metric `acc`; lmms-eval's record says higher is better: the highest is kept, not the lowest
    (which a loss-like name would keep). The hook is the run's own, on real checkpoint folders."""
    from lavis_ds.runners import checkpoint as ckpt
    from lavis_ds.runners.hooks import BestCheckpoint

    metric = "lmms_eval/demo_shapes_colour/acc"
    hook = BestCheckpoint(metric=metric, keep_last=1)
    trainer = SimpleNamespace(rank=0, state=SimpleNamespace(global_step=0), checkpoint_dir=tmp_path)
    for step, value in [(1, 0.25), (2, 0.75), (3, 0.5)]:
        trainer.state.global_step = step
        hook.log(trainer, {"step": step, "epoch": 0, "split": "lmms_eval", "demo_shapes_colour/acc": value,
                           "higher_is_better": {metric: True}})
        (tmp_path / f"step_{step}").mkdir()
        ckpt.mark_complete(tmp_path / f"step_{step}", {"global_step": step})
        hook.after_save(trainer, tmp_path / f"step_{step}")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]
    assert json.loads((tmp_path / "step_2" / BestCheckpoint.SCORE_FILE).read_text()) == {
        "metric": metric, "value": 0.75, "higher_is_better": True}
