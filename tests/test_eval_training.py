"""Evaluation during training, end to end: one short torchrun of train.py, shared by the assertions.

Validation every 5 steps and at epoch ends generates and scores captions (exact_match, caption);
every checkpoint cut right after a validation records its val/caption/CIDEr; keep_last=1 keeps the
newest checkpoint and the best by that score. Config errors are checked in-process.
"""
from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import demo_storage_fixture
from lavis_ds.config import ConfigError, load_config
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.hooks import BestCheckpoint
from run_utils import metrics, run_train, tiny_config, write_yaml

CAPTION_KEYS = {"caption/Bleu_1", "caption/Bleu_2", "caption/Bleu_3", "caption/Bleu_4", "caption/CIDEr"}


demo_storage = demo_storage_fixture(num_train=128, num_val=16, num_test=8)


def _config(out, demo_storage, **run):
    run = {"val_metrics": ["exact_match", "caption"], "test_metrics": ["exact_match", "caption"], **run}
    return tiny_config(out, demo_storage, stage=2, max_epoch=2, valid_splits=["val"], test_splits=["test"],
                       generate={"max_new_tokens": 4}, **run)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, demo_storage):
    root = tmp_path_factory.mktemp("eval_run")
    out = root / "out"
    cfg = _config(out, demo_storage, val_freq_steps=5, save_freq_steps=5, keep_last=1,
                  best_metric="val/caption/CIDEr", hooks=["tensorboard", "mlflow"])
    run_train(write_yaml(root / "run.yaml", cfg), nproc=2)
    return out


def test_validation_scores_generation_every_n_steps_and_at_epoch_ends(run_dir):
    val = [m for m in metrics(run_dir) if m.get("split") == "val"]
    # 2 epochs x 16 steps: every 5th step, plus the epoch ends 16 and 32 (no second line at a shared step).
    assert [m["step"] for m in val] == [5, 10, 15, 16, 20, 25, 30, 32]
    for m in val:
        assert m["num_samples"] == 16 and m["loss"] > 0 and 0 <= m["exact_match"] <= 1
        assert CAPTION_KEYS <= set(m) and all(m[k] >= 0 for k in CAPTION_KEYS)
    test = [m for m in metrics(run_dir) if m.get("split") == "test"]
    assert len(test) == 1 and test[0]["num_samples"] == 8 and CAPTION_KEYS | {"exact_match"} <= set(test[0])


def test_predictions_files_hold_image_prompt_references_and_generated(run_dir, demo_storage):
    folder = run_dir / "predictions"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"val_step{s}.jsonl" for s in (5, 10, 15, 16, 20, 25, 30, 32)] + ["test_step32.jsonl"])
    test = [json.loads(line) for line in (folder / "test_step32.jsonl").read_text().splitlines()]
    annotations = json.loads((demo_storage / "annotations" / "test.json").read_text())
    assert [r["index"] for r in test] == list(range(8))
    for r, record in zip(test, annotations, strict=True):
        assert r["image"] == record["image"] and r["prompt"] == record["instruction"]
        assert r["references"] == [record["output"]] and isinstance(r["generated"], str)
    logged = [m for m in metrics(run_dir) if m.get("split") == "test"][0]["samples"]
    assert [s["generated"] for s in logged] == [r["generated"] for r in test[:len(logged)]]


def test_keep_last_keeps_the_newest_and_the_best_checkpoint_by_best_metric(run_dir):
    val = {m["step"]: m["caption/CIDEr"] for m in metrics(run_dir) if m.get("split") == "val"}
    saved = [5, 10, 15, 16, 20, 25, 30, 32]  # save_freq_steps=5 and epoch ends: each right after a validation
    best = max(saved, key=lambda s: (val[s], -s))  # highest CIDEr, the earliest of equals
    kept = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == sorted({best, 32})
    score = json.loads((run_dir / "checkpoints" / f"step_{best}" / "lavis_ds_score.json").read_text())
    assert score == {"metric": "val/caption/CIDEr", "value": val[best], "higher_is_better": True}


def test_tensorboard_has_the_validation_scores(run_dir):
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    cider = events.Scalars("val/caption/CIDEr")
    assert [e.step for e in cider] == [5, 10, 15, 16, 20, 25, 30, 32]
    assert [e.value for e in events.Scalars("test/exact_match")] == [
        pytest.approx(m["exact_match"]) for m in metrics(run_dir) if m.get("split") == "test"]


def test_mlflow_has_the_validation_scores_and_each_step_once_from_rank_0(run_dir, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told to
    client = MlflowClient((run_dir / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("lavis_ds").experiment_id])
    val = [m for m in metrics(run_dir) if m.get("split") == "val"]
    cider = client.get_metric_history(run.info.run_id, "val/caption/CIDEr")
    assert sorted((m.step, m.value) for m in cider) == [(m["step"], m["caption/CIDEr"]) for m in val]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 33))  # 2 processes, each step once: only rank 0 logs


@pytest.mark.parametrize("run, message", [
    ({"test_metrics": ["captoin"]}, r"run\.test_metrics\[0\]: Unknown metric 'captoin'\. Did you mean 'caption'\?"
                                    r" Known metrics: caption, exact_match, vqa_accuracy"),
    ({"val_metrics": ["bleu"]}, r"run\.val_metrics\[0\]: Unknown metric 'bleu'.*Known metrics: caption"),
    ({"best_metric": "val/caption/CIDEr", "val_metrics": []},
     r"run\.best_metric: 'val/caption/CIDEr' is not logged by validation; choose one of: val/loss$"),
    ({"best_metric": "val/CIDEr"}, r"choose one of: val/loss, val/exact_match, val/caption/Bleu_1, .*val/caption/CIDEr"),
    ({"val_freq_steps": -1}, r"run\.val_freq_steps: expected 0"),
])
def test_metric_config_errors_name_the_key_and_the_valid_choices(tmp_path, demo_storage, run, message):
    cfg = _config(tmp_path / "out", demo_storage, **run)
    with pytest.raises(ConfigError, match=message):
        load_config(write_yaml(tmp_path / "bad.yaml", cfg))


def test_a_dataset_section_names_its_own_metrics(tmp_path, demo_storage):
    cfg = _config(tmp_path / "out", demo_storage, best_metric="val/vqa_accuracy")
    cfg["datasets"]["demo_shapes"]["metrics"] = ["vqa_accuracy"]
    assert list(load_config(write_yaml(tmp_path / "ok.yaml", cfg)).datasets.demo_shapes.metrics) == ["vqa_accuracy"]
    cfg["datasets"]["demo_shapes"]["metrics"] = ["vqa"]
    with pytest.raises(ConfigError, match=r"datasets\.demo_shapes\.metrics\[0\]: Unknown metric 'vqa'"):
        load_config(write_yaml(tmp_path / "bad.yaml", cfg))


def _scored(root, step, metric, value, higher, complete=True):
    tag_dir = root / f"step_{step}"
    tag_dir.mkdir(parents=True)
    if complete:
        ckpt.mark_complete(tag_dir, {"global_step": step})
    (tag_dir / BestCheckpoint.SCORE_FILE).write_text(json.dumps(
        {"metric": metric, "value": value, "higher_is_better": higher}))


def test_the_best_checkpoint_follows_the_metric_direction_and_ignores_other_scores(tmp_path):
    best = BestCheckpoint().best
    _scored(tmp_path, 2, "val/loss", 0.7, False)
    _scored(tmp_path, 4, "val/loss", 0.5, False)
    _scored(tmp_path, 6, "val/loss", 0.1, False, complete=False)  # a torn save never counts
    _scored(tmp_path, 8, "val/caption/CIDEr", 0.9, True)
    _scored(tmp_path, 10, "val/caption/CIDEr", 1.2, True)
    _scored(tmp_path, 12, "val/caption/CIDEr", 1.2, True)  # a tie: the earlier one stays the best
    assert best(tmp_path, "val/loss") == tmp_path / "step_4"
    assert best(tmp_path, "val/caption/CIDEr") == tmp_path / "step_10"
    assert best(tmp_path, "test/exact_match") is None and best(tmp_path, None) is None


def test_predictions_that_cannot_be_written_are_one_clear_error(tmp_path):
    """A full disk under the predictions file: OutputError naming the file, and no part-written file left."""
    from lavis_ds.common.errors import OutputError
    from lavis_ds.runners.hooks.evaluation import write_predictions

    path = tmp_path / "predictions" / "test_step8.jsonl"
    path.parent.mkdir()
    path.with_suffix(".jsonl.tmp").symlink_to("/dev/full")
    record = {"index": 0, "dataset": "d", "image": "a.png", "prompt": "What?", "references": ["x"], "generated": "x"}
    with pytest.raises(OutputError, match=r"cannot write the predictions .*test_step8\.jsonl: No space left on device"):
        write_predictions(path, [record] * 1000)
    assert not path.exists() and not path.with_suffix(".jsonl.tmp").exists()
