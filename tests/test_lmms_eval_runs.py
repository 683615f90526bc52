"""Benchmarks in the loop (`run.lmms_eval`) on 2 processes: one tiny run under ZeRO-3 and one under FSDP2, on the
demo's offline lmms-eval tasks (projects/demo/lmms_eval: a generation task scored by exact match, a multiple-choice
task scored by log-likelihoods).

- Every rank takes a share of the requests, and the live model's predictions and scores at a step equal those of
  `lavis-ds eval` on that step's checkpoint (its result files):
  the same generated answers, the same chosen options and per-document scores, the same task scores; the
  log-likelihoods agree to 1e-5 (ZeRO-3's own linear layers round differently from torch's in the 7th digit).
- The ZeRO-3 run evaluates every step and is killed during its evaluation of the last one (rank 0 held while
  writing that evaluation's predictions: a FIFO where the file's temporary copy goes blocks the write, as
  tests/test_resume.py holds a save); its rerun evaluates that step again and metrics.jsonl has one row per
  evaluated step. The FSDP2 run evaluates at its epoch ends (`every: epoch`).
- `run.best_metric: lmms_eval/demo_shapes_colour/acc` scores the checkpoints of evaluated steps and keep_last=1 keeps
  the newest and the best by it.

Cost: two 2-process training runs of 2 steps (the ZeRO-3 one killed and rerun from its step-1 checkpoint), each
evaluating 2 documents per task twice, two in-process `lavis-ds eval` runs on a checkpoint, and the cost benchmark
(benchmarks/lmms_eval_cost.py) for one step and 2 documents in one process: 30-50 s on the shared 2-core machine
once the suite's process server is up (starting it adds some 15 s to whichever run is first). An evaluation that
fails on one rank at step 1 (a task's scoring on rank 0, a document's image on rank 1): three 2-process runs of one
or two steps, stopped there (`on_error: stop`) or training on (`continue`), 5-7 s each; `lavis-ds eval` on 2
processes on the FSDP2 run's checkpoint with either failure, 3-4 s each, and lmms-eval's own command line there with
the image failure, 4-5 s.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import demo_storage_fixture
from harness import REPO
from lavis_ds.runners.hooks.lmms_eval_checks import scores_of
from harness.forked import STILL_RUNNING
from run_utils import kill, metrics, run_forked, run_train, start, tiny_config, write_yaml

TASKS = ["demo_shapes_caption", "demo_shapes_colour"]
INCLUDE = REPO / "projects" / "demo" / "lmms_eval"
LIMIT = 2  # documents per task: one per rank
BEST = "lmms_eval/demo_shapes_colour/acc"

demo_storage = demo_storage_fixture(num_train=16, num_val=8, num_test=16)  # the demo tasks read test_00000..15
LAST = 2  # the last optimizer step of either run


@pytest.fixture(scope="module", autouse=True)
def offline(demo_storage, tmp_path_factory):
    """The demo tasks read their images from $LAVIS_DS_DEMO_DATA (projects/demo/lmms_eval/utils.py); nothing
    reaches the network, and the datasets cache is this module's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAVIS_DS_DEMO_DATA", str(demo_storage))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets_cache")))
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


def test_each_evaluated_step_has_one_row_with_the_tasks_scores_and_its_time_share_in_every_tracker(run_dir):
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, LAST]  # one row for the last step after the kill and the rerun
    for row in rows:
        assert 0 <= row["demo_shapes_caption/exact_match"] <= 1 and 0 <= row["demo_shapes_colour/acc"] <= 1
        assert row["num_samples"] == 2 * LIMIT and row["seconds"] > 0 and 0 < row["time_share"] < 1
        assert row["higher_is_better"] == {"lmms_eval/demo_shapes_caption/exact_match": True, BEST: True}
    events = EventAccumulator(str(run_dir / "tb"))  # the trackers get the rows as metrics.jsonl has them
    events.Reload()
    scalars = events.Scalars(BEST)
    assert [e.step for e in scalars] == [r["step"] for r in rows]
    assert [e.value for e in scalars] == pytest.approx([r["demo_shapes_colour/acc"] for r in rows])  # float32
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


def test_the_live_model_scores_as_lavis_ds_eval_on_the_checkpoint(run_dir, tmp_path, request):
    """`lavis-ds eval` on the last checkpoint: its result files against the run's. On the ZeRO-3 run's, one process
    (this one); on the FSDP2 run's, two, as torchrun starts them: each answers its share, rank 0 writes the files."""
    from lavis_ds.cli import main

    out = tmp_path / "eval"
    argv = ["--model", str(run_dir / "checkpoints" / f"step_{LAST}"), "--tasks", ",".join(TASKS), "--include_path",
            str(INCLUDE), "--limit", str(LIMIT), "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    if request.node.callspec.params["run_dir"] == "fsdp2":
        proc = run_forked("lavis_ds.apps.eval:main", argv, tmp_path / "logs", nproc=2, timeout=240)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    else:
        assert main(["eval", *argv]) == 0
    [results_file] = out.glob("*/*_results.json")
    results = json.loads(results_file.read_text())
    live = [r for r in _rows(run_dir) if r["step"] == LAST][0]
    scores = {k: v for k, v in scores_of(results)[0].items() if "_stderr" not in k}  # the loop bootstraps none
    assert set(scores) == {"demo_shapes_caption/exact_match", "demo_shapes_colour/acc"}
    assert {k: live[k] for k in scores} == scores
    for task in TASKS:
        [samples_file] = out.glob(f"*/*_samples_{task}.jsonl")
        offline = sorted((json.loads(line) for line in samples_file.read_text().splitlines()),
                         key=lambda s: s["doc_id"])
        in_training = _predictions(run_dir, task, LAST)
        assert [str(p["target"]) for p in in_training] == [s["target"] for s in offline]  # the file writes str()
        assert [p[METRIC[task]] for p in in_training] == [s[METRIC[task]] for s in offline]
        if task == "demo_shapes_caption":  # the generated text, as scored
            # lmms-eval's samples file flattens a document's one answer ([text] -> text)
            assert [p["filtered_resps"] for p in in_training] == [[s["filtered_resps"]] for s in offline]
        else:  # per option (score, greedy): ZeRO-3's own linear layers round apart from torch's in the 7th digit
            for mine, theirs in zip([p["filtered_resps"] for p in in_training],
                                    [_options(s["filtered_resps"]) for s in offline], strict=True):
                assert [greedy for _, greedy in mine] == [greedy for _, greedy in theirs]
                assert [v for v, _ in mine] == pytest.approx([v for v, _ in theirs], rel=1e-5, abs=1e-5)


METRIC = {"demo_shapes_caption": "exact_match", "demo_shapes_colour": "acc"}


def _options(written: list) -> list[tuple[float, bool]]:
    """A multiple-choice document's per-option (score, greedy) pairs from lmms-eval's samples file (which writes
    every value as a string)."""
    return [(float(score), greedy in (True, "True")) for score, greedy in written]


def test_the_cost_benchmark_times_an_evaluation_against_a_step(tmp_path, demo_storage):
    """benchmarks/lmms_eval_cost.py, one process forked from the suite's server, one step and one evaluation of 2
    documents: so that it cannot break unnoticed (its figures are the ones docs/benchmarks.md reports)."""
    figures = tmp_path / "figures.json"
    cfg = write_yaml(tmp_path / "bench.yaml", tiny_config(tmp_path / "out", demo_storage))
    proc = run_forked("benchmarks.lmms_eval_cost:main", [
        "--cfg-path", str(cfg), "--tasks", "demo_shapes_colour", "--requests", "2", "--steps", "1", "--warmup", "1",
        "--repeats", "1", "--json", str(figures)], tmp_path / "logs")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    written = json.loads(figures.read_text())
    assert written["documents"] == 2 and written["step_s"] > 0 and written["eval_s"] > 0 and 0 < written["share"] < 1


# ----------------------------------------------------------------------------- an evaluation that fails on one rank
FAILING_TASK = """include: {include}/demo_shapes_caption.yaml
task: {task}
dataset_kwargs:
  data_files:
    test: {include}/demo_shapes_test.json
{override}
"""
OVERRIDES = {  # the task's own function that fails, and the rank it fails on
    "scoring": ("metric_list:\n  - metric: exact_match\n    aggregation: !function failing.mean_after_one_failure\n"
                "    higher_is_better: true", 0),
    "image": ("doc_to_visual: !function failing.image_but_the_second", 1),
}
FAILING = """import os
from pathlib import Path

from PIL import Image

FAILED = Path(__file__).with_name("failed_once")


def mean_after_one_failure(items):
    \"\"\"lmms-eval's aggregation of the task, on rank 0 alone: it fails the first time, then averages.\"\"\"
    if not FAILED.exists():
        FAILED.write_text("")
        raise ZeroDivisionError("the task's scorer failed")
    return sum(items) / len(items)


def image_but_the_second(doc):
    \"\"\"The document's image; the second document's (rank 1's: lmms-eval gives document i to rank i mod 2) is
    missing.\"\"\"
    if doc["image"] == "test_00001.png":
        raise FileNotFoundError("images/test_00001.png is missing")
    with Image.open(Path(os.environ["LAVIS_DS_DEMO_DATA"]) / "images" / doc["image"]) as image:
        return [image.convert("RGB")]
"""


@pytest.mark.parametrize("case, on_error", [("scoring", "stop"), ("scoring", "continue"), ("image", "stop")])
def test_an_evaluation_failing_on_one_rank_stops_every_rank_or_every_rank_trains_on(tmp_path, demo_storage, case,
                                                                                      on_error):
    """At step 1 the task's scoring (lmms-eval's aggregation, on rank 0 alone) fails while rank 1 waits at
    lmms-eval's closing barrier, or rank 1 cannot load its document's image while rank 0 goes on to lmms-eval's
    gathers. `stop`: both ranks end there, one `lavis_ds:` line naming the task, the step and the rank, no rank
    left running (forked.Job kills one still running after its peer failed, and says so). `continue`: the line says
    so, step 1 has no record, and both ranks train on to step 2, whose evaluation scores."""
    tasks, task, rank = _failing_task(tmp_path, case)
    out = tmp_path / "out"
    cfg = tiny_config(out, demo_storage, lmms_eval={"tasks": [task], "every": 1, "limit": LIMIT,
                                                    "include_path": str(tasks), "on_error": on_error})
    proc = run_train(write_yaml(tmp_path / "run.yaml", cfg), check=False, timeout=180)  # a hang fails, 10x its time
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lavis_ds:") and "MFU" not in line]
    cause = _cause(case, task)
    then = ("the run stops here; set run.lmms_eval.on_error: continue to train on when an evaluation fails"
            if on_error == "stop" else
            "training continues without this evaluation's scores (run.lmms_eval.on_error: continue)")
    assert lines == [(f"lavis_ds: run.lmms_eval: evaluating task {task} at optimizer step 1 failed on rank {rank}: "
                      f"{cause}; {then}")], proc.stderr[-4000:]
    assert STILL_RUNNING not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == (1 if on_error == "stop" else 0), proc.stderr[-4000:]
    if on_error == "continue":
        assert [m["step"] for m in metrics(out) if "split" not in m] == [1, LAST]
        assert [r["step"] for r in _rows(out)] == [LAST]


def _failing_task(tmp_path: Path, case: str) -> tuple[Path, str, int]:
    """A folder with the demo caption task whose ``case`` function fails: the folder, the task and the failing rank."""
    tasks, task = tmp_path / "tasks", f"demo_shapes_failing_{case}"
    tasks.mkdir()
    override, rank = OVERRIDES[case]
    (tasks / f"{task}.yaml").write_text(FAILING_TASK.format(include=INCLUDE, task=task, override=override))
    (tasks / "failing.py").write_text(FAILING)
    return tasks, task, rank


def _cause(case: str, task: str) -> str:
    return {"scoring": "ZeroDivisionError: the task's scorer failed",
            "image": f"task {task} (test doc 1): FileNotFoundError: images/test_00001.png is missing"}[case]


@pytest.mark.parametrize("case", ["scoring", "image"])
def test_lavis_ds_eval_failing_on_one_of_two_processes_stops_both_with_one_line(tmp_path, fsdp_run, case):
    """`lavis-ds eval` on 2 processes (its only multi-process run in the suite) on the FSDP2 run's checkpoint, with
    the failures above: both processes end at once with the failing rank's one line and its code (1), none left
    waiting in a collective (forked.Job would kill it after 30 s and say so; a hang fails at the timeout)."""
    tasks, task, rank = _failing_task(tmp_path, case)
    proc = run_forked("lavis_ds.apps.eval:main", [
        "--model", str(fsdp_run / "checkpoints" / f"step_{LAST}"), "--tasks", task, "--include_path", str(tasks),
        "--limit", str(LIMIT), "--output_path", str(tmp_path / "eval")], tmp_path / "logs", nproc=2, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lavis_ds:")]
    assert lines == [f"lavis_ds: lavis-ds eval: evaluating task {task} failed on rank {rank}: {_cause(case, task)}"], \
        proc.stderr[-4000:]
    assert STILL_RUNNING not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert not list((tmp_path / "eval").glob("*/*_results.json"))  # no result files of a failed evaluation


def test_lavis_ds_eval_whose_model_one_process_cannot_load_stops_both_with_one_line(tmp_path, fsdp_run):
    """Rank 1 cannot find the model folder (a node without the checkpoint) while rank 0 loads it: both agree before
    lmms-eval's first collective and end with rank 1's line and its code (2, a bad path), none left waiting."""
    model = fsdp_run / "checkpoints" / f"step_{LAST}"
    proc = run_forked("lmms_eval_runs:eval_where_rank_1_lacks_the_model", [
        "--model", str(model), "--tasks", TASKS[0], "--include_path", str(INCLUDE), "--limit", str(LIMIT)],
        tmp_path / "logs", nproc=2, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lavis_ds:")]
    assert lines == [f"lavis_ds: lavis-ds eval: preparing the evaluation failed on rank 1: {model}_not_on_this_node "
                     "does not exist"], proc.stderr[-4000:]
    assert STILL_RUNNING not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 2, proc.stderr[-4000:]


def test_lmms_eval_s_own_command_line_failing_on_one_of_two_processes_ends_both(tmp_path, fsdp_run):
    """`lmms-eval --model lavis_ds` on 2 processes (lmms-eval's CLI, which catches an evaluation's error on each rank
    and exits 0) whose rank 1 cannot load its document's image: the ranks agree at the end of generate_until, so both
    raise, lmms-eval prints the failing rank's line on rank 1 and the peer's on rank 0, writes no result files, and
    both processes end (a hang fails at the timeout: without the agreement rank 0 waits in lmms-eval's gather)."""
    tasks, task, rank = _failing_task(tmp_path, "image")
    proc = run_forked("lmms_eval_runs:lmms_eval_command_line", [
        "--model", "lavis_ds", "--model_args", f"pretrained={fsdp_run / 'checkpoints' / f'step_{LAST}'}",
        "--tasks", task, "--include_path", str(tasks), "--limit", str(LIMIT), "--output_path", str(tmp_path / "eval")],
        tmp_path / "logs", nproc=2, timeout=180)
    line = f"lmms-eval --model lavis_ds: evaluating task {task} failed on rank {rank}: {_cause('image', task)}"
    # what lmms-eval prints of each rank's error: the failing rank's line, and its peer's PeerFailed with it
    assert f"EvaluationFailed: {line}\n" in proc.stderr, proc.stderr[-4000:]
    assert f"PeerFailed: rank {rank} failed: {line}\n" in proc.stderr, proc.stderr[-4000:]
    assert STILL_RUNNING not in proc.stderr and proc.returncode == 0, proc.stderr[-4000:]  # lmms-eval's exit code
    assert not list((tmp_path / "eval").glob("**/*_results.json"))  # no result files of a failed evaluation
