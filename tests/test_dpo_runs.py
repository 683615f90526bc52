"""DPO through train.py on real processes (fp32, the tiny BLIP2-Qwen on the demo's preference pairs): the step is
the mean over the global batch's pairs whatever the split, ZeRO 0-3 and FSDP2 take the same steps, a SIGKILLed run
continues bit for bit, and a 2-process checkpoint continues on 1 process. The reference log-probs are precomputed
(the tiny model has no LoRA) and stored in the run folder."""
from __future__ import annotations

import json
import random
import shutil

import pytest

import forked
from lavis_ds.datasets.demo_pairs import ensure_demo_pairs
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import (REPO, assert_same_steps, comparable, continue_from, env, kill_after_step, output_of, run_train,
                       start, tiny_config, train_args, train_steps, write_yaml)

PAIRS_PER_STEP = 8
STEPS = 4
SPLITS = {  # name: (processes, micro-batch, accumulation, engine (run.runner), ZeRO stage)
    "8x1": (1, 8, 1, "runner_deepspeed", 2),
    "2x4": (1, 2, 4, "runner_deepspeed", 2),
    "2x2 on 2, zero0": (2, 2, 2, "runner_deepspeed", 0),
    "4x1 on 2, zero2": (2, 4, 1, "runner_deepspeed", 2),
    "4x1 on 2, zero3": (2, 4, 1, "runner_deepspeed", 3),
    "4x1 on 2, fsdp": (2, 4, 1, "runner_fsdp", 2),
}
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
           "logps/rejected", "nll")


@pytest.fixture(scope="module")
def demo_storage(tmp_path_factory):
    storage = tmp_path_factory.mktemp("demo") / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=PAIRS_PER_STEP * STEPS, num_val=8, num_test=8))
    ensure_demo_pairs(storage)
    return storage


def dpo_config(out, storage, micro: int = 4, accum: int = 1, runner: str = "runner_deepspeed", stage: int = 2,
               **run) -> dict:
    """DPO with an RPO term (both units, pairs and tokens, in one loss) on the demo's pairs, dropout off."""
    cfg = tiny_config(out, storage, stage=stage, micro=micro, accum=accum, runner=runner, warmup_steps=0,
                      task="dpo", dpo={"beta": BETA, "rpo_alpha": 0.5}, valid_splits=["val"], **run)
    cfg["datasets"] = {"demo_shape_pairs": {"build_info": {"storage": str(storage), "num_train": PAIRS_PER_STEP * STEPS,
                                                           "num_val": 8, "num_test": 8}}}
    cfg["run"]["init_lr"] = 3e-3
    return cfg


BETA = 0.5


def _relative(a: float, b: float) -> float:
    """Relative difference, absolute below 1: step 1's rewards are differences of equal log-probs (0 exactly on one
    split, one fp32 rounding of a ~-30 log-prob sum, times beta, on another), so a relative error of them means
    nothing."""
    return abs(a - b) / max(abs(b), 1.0)


@pytest.fixture(scope="module")
def curves(tmp_path_factory, demo_storage):
    root = tmp_path_factory.mktemp("dpo_splits")
    jobs, result = {}, {}
    # The 2-process jobs one at a time, then the single processes (which pick their own free port when they start).
    for name, (nproc, micro, accum, runner, stage) in sorted(SPLITS.items(), key=lambda item: -item[1][0]):
        folder = root / name.replace(" ", "_").replace(",", "")
        folder.mkdir(parents=True)
        cfg_path = write_yaml(folder / "run.yaml", dpo_config(folder / "out", demo_storage, micro, accum, runner, stage))
        job = forked.Job(train_args(cfg_path), nproc if nproc > 1 else 0, env(), REPO, folder / "logs")
        assert job.wait(600) == 0, job.output()[1][-3000:]
        result[name] = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    result["folders"] = {name: root / name.replace(" ", "_").replace(",", "") / "out" for name in SPLITS}
    return result


@pytest.mark.parametrize("split", [name for name in SPLITS if name != "8x1"])
def test_the_dpo_step_does_not_depend_on_the_split_or_the_engine(curves, split):
    """Step 1 to 1e-6 (loss, gradient norm, every metric); the curve within the SFT tests' engine tolerance."""
    reference = [m for m in curves["8x1"] if "split" not in m]
    mine = [m for m in curves[split] if "split" not in m]
    assert [m["step"] for m in mine] == [m["step"] for m in reference] == list(range(1, STEPS + 1))
    for key in METRICS:
        assert _relative(mine[0][key], reference[0][key]) < 1e-6, (key, mine[0], reference[0])
    # The policy is the reference at step 1: margins 0 up to one rounding of the log-prob sums (the reference pass
    # batches the pairs as the split does not, and fp32 matmuls of other shapes round otherwise).
    assert abs(mine[0]["rewards/margins"]) < 1e-6 and abs(reference[0]["rewards/margins"]) < 1e-6
    for m, t in zip(mine, reference):
        for key in METRICS:
            # A reward is beta times a difference of log-prob sums (a margin, of two rewards): its rounding is theirs.
            scale = (max(abs(t[key]), BETA * abs(t["logps/chosen"]), BETA * abs(t["logps/rejected"]))
                     if key.startswith("rewards/") else abs(t[key]))
            assert abs(m[key] - t[key]) <= 1e-5 * scale, (key, m, t)
    assert mine[-1]["loss"] < mine[0]["loss"]  # it trains
    val_mine = next(m for m in curves[split] if m.get("split") == "val")
    val_reference = next(m for m in curves["8x1"] if m.get("split") == "val")
    assert val_mine["num_pairs"] == val_reference["num_pairs"] == 8
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert _relative(val_mine[key], val_reference[key]) < 1e-5, (key, val_mine, val_reference)


def test_the_reference_pass_is_stored_in_the_run_folder(curves):
    out = curves["folders"]["8x1"]
    stores = list((out / "reference_logps").glob("*/reference_logps.pt"))
    assert len(stores) == 1 and not list(out.glob("reference_logps/*/*.tmp"))


def test_the_preference_metrics_reach_tensorboard(curves):
    """What metrics.jsonl has, TensorBoard has: training steps and the held-out pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(curves["folders"]["8x1"] / "tb"))
    events.Reload()
    logged = {m["step"]: m for m in curves["8x1"] if "split" not in m}
    for name in ("rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/accuracies", "logps/rejected"):
        train = {e.step: e.value for e in events.Scalars(f"train/{name}")}
        assert train == pytest.approx({step: m[name] for step, m in logged.items()}, rel=1e-6), name
        assert len(events.Scalars(f"val/{name}")) >= 1


def test_a_killed_dpo_run_continues_bit_for_bit_and_on_one_process(tmp_path, demo_storage):
    """ZeRO-2 on 2 processes, SIGKILLed after a random step and rerun = the same run uninterrupted; then its epoch-end
    checkpoint continued on 1 process (the global batch kept: accumulation doubles) takes the same steps."""
    def config(out):
        return dpo_config(out, demo_storage, micro=2, accum=2, max_epoch=3, save_freq_steps=3)

    reference_out, killed_out = tmp_path / "reference", tmp_path / "killed"
    reference = start(write_yaml(tmp_path / "reference.yaml", config(reference_out)))
    killed_cfg = write_yaml(tmp_path / "killed.yaml", config(killed_out))
    kill_step = random.randint(4, 3 * STEPS - 2)
    kill_after_step(start(killed_cfg), killed_out, kill_step)
    rerun = run_train(killed_cfg)
    assert reference.wait(timeout=600) == 0, output_of(reference)[-4000:]
    assert "resumed from" in rerun.stdout, f"kill after step {kill_step}: no resume\n{rerun.stdout[-2000:]}"
    expected = comparable(train_steps(reference_out))
    assert len(expected) == 3 * STEPS
    assert comparable(train_steps(killed_out)) == expected, f"killed after step {kill_step}"

    elastic_out = tmp_path / "elastic"
    # the run folder moves with its checkpoint: the reference log-probs of the starting weights are in it
    shutil.copytree(reference_out / "reference_logps", elastic_out / "reference_logps")
    rerun = continue_from(reference_out / "checkpoints" / f"step_{STEPS}",
                          write_yaml(tmp_path / "elastic.yaml", config(elastic_out)), elastic_out, nproc=0)
    assert f"resumed from {elastic_out / 'checkpoints' / f'step_{STEPS}'}" in rerun.stdout, rerun.stdout[-2000:]
    assert_same_steps(elastic_out, reference_out, range(STEPS + 1, 3 * STEPS + 1), 1e-5)
