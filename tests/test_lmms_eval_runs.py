"""Benchmarks in the loop (`run.lmms_eval`) on 2 processes: one tiny run under ZeRO-3 and one under FSDP2, on the
demo's offline lmms-eval tasks (projects/demo/lmms_eval: a generation task scored by exact match, a multiple-choice
task scored by log-likelihoods).

- Every rank takes a share of the requests, and the live model's predictions and scores at a step equal those of
  lmms-eval run on that step's checkpoint by the class `lavis-ds eval` loads it with (``PretrainedLavisDsLmms``):
  the same generated answers, the same chosen options and per-document scores, the same task scores; the
  log-likelihoods agree to 1e-5 (ZeRO-3's own linear layers round differently from torch's in the 7th digit).
- The ZeRO-3 run evaluates every step and is killed during its evaluation of the last one (rank 0 held while
  writing that evaluation's predictions: a FIFO where the file's temporary copy goes blocks the write, as
  tests/test_resume.py holds a save); its rerun evaluates that step again and metrics.jsonl has one row per
  evaluated step. The FSDP2 run evaluates at its epoch ends (`every: epoch`).
- `run.best_metric: lmms_eval/demo_shapes_colour/acc` scores the checkpoints of evaluated steps and keep_last=1 keeps
  the newest and the best by it.

Cost: two 2-process training runs of 2 steps (the ZeRO-3 one killed and rerun from its step-1 checkpoint), each
evaluating 2 documents per task twice, and two in-process lmms-eval evaluations of a checkpoint.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from conftest import demo_storage_fixture
from harness import REPO
from run_utils import kill, metrics, run_train, start, tiny_config, write_yaml

TASKS = ["demo_shapes_caption", "demo_shapes_colour"]
INCLUDE = REPO / "projects" / "demo" / "lmms_eval"
LIMIT = 2  # documents per task: one per rank
BEST = "lmms_eval/demo_shapes_colour/acc"

demo_storage = demo_storage_fixture(num_train=16, num_val=8, num_test=16)  # the demo tasks read test_00000..15
LAST = 2  # the last optimizer step of either run


@pytest.fixture(scope="module", autouse=True)
def demo_task_images(demo_storage):
    """The demo tasks read their images from $LAVIS_DS_DEMO_DATA (projects/demo/lmms_eval/utils.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAVIS_DS_DEMO_DATA", str(demo_storage))
        yield


def _config(out: Path, demo_storage: Path, runner: str, stage: int | None, every: int | str, **run) -> dict:
    """2 optimizer steps (micro 4 x 2 processes), a checkpoint every step, benchmarks ``every``."""
    return tiny_config(out, demo_storage, stage=stage, runner=runner, save_freq_steps=1, keep_last=1,
                       best_metric=BEST, lmms_eval={"tasks": TASKS, "every": every, "limit": LIMIT, "batch_size": 1,
                                                    "include_path": str(INCLUDE)}, **run)


@pytest.fixture(scope="module")
def zero3_killed_run(tmp_path_factory, demo_storage):
    """A ZeRO-3 run of 16 samples killed during its step-2 evaluation, then run again to the end: its output_dir."""
    root = tmp_path_factory.mktemp("lmms_eval_zero3")
    out = root / "out"
    cfg = write_yaml(root / "run.yaml", _config(out, demo_storage, "runner_deepspeed", 3, every=1))
    # The second task's file of the step is written after the first's: hold rank 0 there, mid-evaluation.
    held = out / "predictions" / f"lmms_eval_demo_shapes_colour_step{LAST}.jsonl.tmp"
    held.parent.mkdir(parents=True)
    os.mkfifo(held)
    job = start(cfg)
    first = held.parent / f"lmms_eval_demo_shapes_caption_step{LAST}.jsonl"
    deadline = time.time() + 600
    while not first.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert first.exists(), "the run did not reach its last evaluation in time"
    time.sleep(1.0)
    assert job.poll() is None, "the run ended instead of blocking in its last evaluation"
    kill(job)
    killed = metrics(out)
    assert [m["step"] for m in killed if m.get("split") == "lmms_eval"] == [1], "the last row came before the kill"
    assert not (out / "checkpoints" / f"step_{LAST}").exists(), "a checkpoint of a step whose evaluation is not done"
    held.unlink()
    run_train(cfg)
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, demo_storage):
    root = tmp_path_factory.mktemp("lmms_eval_fsdp")
    out = root / "out"
    cfg = _config(out, demo_storage, "runner_fsdp", None, every="epoch", max_epoch=2, micro=8)  # a step an epoch
    run_train(write_yaml(root / "run.yaml", cfg))
    return out


@pytest.fixture(params=["zero3", "fsdp2"])
def run_dir(request):
    return request.getfixturevalue({"zero3": "zero3_killed_run", "fsdp2": "fsdp_run"}[request.param])


def _rows(out: Path) -> list[dict]:
    return [m for m in metrics(out) if m.get("split") == "lmms_eval"]


def _predictions(out: Path, task: str, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / "predictions" / f"lmms_eval_{task}_step{step}.jsonl").read_text()
            .splitlines()]


def test_each_evaluated_step_has_one_row_with_the_tasks_scores_and_its_time_share(run_dir):
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, LAST]  # one row for the last step after the kill and the rerun
    for row in rows:
        assert 0 <= row["demo_shapes_caption/exact_match"] <= 1 and 0 <= row["demo_shapes_colour/acc"] <= 1
        assert row["num_samples"] == 2 * LIMIT and row["seconds"] > 0 and 0 < row["time_share"] < 1
        assert row["higher_is_better"] == {"lmms_eval/demo_shapes_caption/exact_match": True, BEST: True}
    for task in TASKS:  # every document of the limit, from both ranks' shares; no temporary file left
        assert [p["doc_id"] for p in _predictions(run_dir, task, LAST)] == list(range(LIMIT))
    assert not list((run_dir / "predictions").glob("*.tmp"))


def test_the_best_checkpoint_is_kept_by_the_lmms_eval_metric(run_dir):
    scores = {r["step"]: r["demo_shapes_colour/acc"] for r in _rows(run_dir)}
    best = max(scores, key=lambda step: (scores[step], -step))  # the highest, the earliest of equals
    kept = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == sorted({best, LAST})
    for step in kept:
        score = json.loads((run_dir / "checkpoints" / f"step_{step}" / "lavis_ds_score.json").read_text())
        assert score == {"metric": BEST, "value": scores[step], "higher_is_better": True}


def test_the_live_model_scores_as_lavis_ds_eval_on_the_checkpoint(run_dir):
    """lmms-eval on the last checkpoint, one process, with the model class `lavis-ds eval` builds from a path."""
    from lmms_eval.evaluator import simple_evaluate

    from lavis_ds.apps.eval_model import PretrainedLavisDsLmms
    from lavis_ds.runners.hooks.lmms_eval_checks import scores_of, task_index

    model = PretrainedLavisDsLmms.from_pretrained(str(run_dir / "checkpoints" / f"step_{LAST}"), batch_size=1)
    results = simple_evaluate(model=model, tasks=TASKS, limit=LIMIT, log_samples=True, bootstrap_iters=0,
                              task_manager=task_index(str(INCLUDE), tuple(TASKS)), distributed_executor_backend="torchrun")
    live = [r for r in _rows(run_dir) if r["step"] == LAST][0]
    assert {k: live[k] for k in scores_of(results)[0]} == scores_of(results)[0]
    for task in TASKS:
        offline = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        in_training = _predictions(run_dir, task, LAST)
        assert [p["target"] for p in in_training] == [s["target"] for s in offline]
        answers = [json.loads(json.dumps(s["filtered_resps"])) for s in offline]  # tuples as the file has them
        if task == "demo_shapes_caption":  # the generated text, as scored
            assert [p["filtered_resps"] for p in in_training] == answers
        else:  # per choice (log-likelihood, greedy): ZeRO-3's gathered linear layers round apart in the 7th digit
            for mine, theirs in zip([p["filtered_resps"] for p in in_training], answers, strict=True):
                assert [greedy for _, greedy in mine] == [greedy for _, greedy in theirs]
                assert [logp for logp, _ in mine] == pytest.approx([logp for logp, _ in theirs], rel=1e-5, abs=1e-5)
                assert _argmax(mine) == _argmax(theirs)  # the chosen colour
        assert [p[METRIC[task]] for p in in_training] == [s[METRIC[task]] for s in offline]


METRIC = {"demo_shapes_caption": "exact_match", "demo_shapes_colour": "acc"}


def _argmax(choices: list) -> int:
    return max(range(len(choices)), key=lambda i: choices[i][0])
