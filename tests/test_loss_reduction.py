"""run.loss_reduction: tokens - an optimizer step's loss is the sum of its token losses over the supervised tokens
of the whole global batch, so the same 16 samples give the same loss and gradient however they are split into
micro-batches, accumulation steps and processes (HF Trainer's num_items_in_batch rule). The runs go through
train.py on real processes, fp32, dropout off."""
from __future__ import annotations

import pytest

import forked
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import REPO, env, tiny_config, train_args, train_steps, write_yaml

STEPS = 10
SPLITS = {  # name: (processes, micro-batch, accumulation, engine (run.runner), loss_reduction)
    "16x1": (1, 16, 1, "runner_deepspeed", "tokens"),
    "4x4": (1, 4, 4, "runner_deepspeed", "tokens"),
    "8x1 on 2": (2, 8, 1, "runner_deepspeed", "tokens"),
    "8x1 on 2, fsdp": (2, 8, 1, "runner_fsdp", "tokens"),
    "4x4, micro_batch": (1, 4, 4, "runner_deepspeed", "micro_batch"),
}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss_reduction")
    storage = ensure_demo_shapes(root / "demo_shapes", DemoShapesSpec(num_train=16 * STEPS, num_val=8, num_test=8))
    jobs, result = {}, {}
    # Two waves, the 2-process jobs first: a single process picks its own free port when it starts, which could
    # be the one a 2-process job was given and has not bound yet.
    for name, (nproc, micro, accum, runner, reduction) in sorted(SPLITS.items(), key=lambda item: -item[1][0]):
        if nproc == 1 and any(SPLITS[started][0] > 1 for started in jobs):
            _wait(jobs, result)
        folder = root / name.replace(" ", "_").replace(",", "")
        cfg = tiny_config(folder / "out", storage, micro=micro, accum=accum, runner=runner, loss_reduction=reduction,
                          warmup_steps=0)
        cfg["model"].update(drop_path_rate=0.0, llm_config={"attention_dropout": 0.0},
                            qformer={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
        folder.mkdir(parents=True)
        cfg_path = write_yaml(folder / "run.yaml", cfg)
        jobs[name] = (folder, forked.Job(train_args(cfg_path), nproc if nproc > 1 else 0, env(), REPO, folder / "logs"))
    _wait(jobs, result)
    return result


def _wait(jobs: dict, result: dict) -> None:
    for name, (folder, job) in list(jobs.items()):
        if name not in result:
            assert job.wait(600) == 0, job.output()[1][-3000:]
            result[name] = train_steps(folder / "out")


@pytest.mark.parametrize("split", ["4x4", "8x1 on 2", "8x1 on 2, fsdp"])
def test_the_step_does_not_depend_on_the_split(curves, split):
    reference, mine = curves["16x1"], curves[split]
    assert [m["step"] for m in mine] == [m["step"] for m in reference] == list(range(1, STEPS + 1))
    first, theirs = mine[0], reference[0]
    assert _relative(first["loss"], theirs["loss"]) < 1e-6, (first, theirs)
    assert _relative(first["grad_norm"], theirs["grad_norm"]) < 1e-6, (first, theirs)
    for m, t in zip(mine, reference):
        assert _relative(m["loss"], t["loss"]) < 1e-5, (m, t)


def test_the_micro_batch_mean_of_old_runs_is_kept_and_differs(curves):
    """LAVIS's mean of micro-batch means weights a short answer's tokens more: another step-1 loss."""
    old, tokens = curves["4x4, micro_batch"][0]["loss"], curves["4x4"][0]["loss"]
    assert _relative(old, tokens) > 1e-5
