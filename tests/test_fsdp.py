"""runner_fsdp (PyTorch FSDP2) on 2 processes: the same steps as DeepSpeed, exact resumption, resharding,
generation under sharding, and clear answers for what it does not do."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pytest

from conftest import demo_storage_fixture
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import (assert_same_steps, continue_from, killed_run_continues_bit_for_bit, metrics, run_train,
                       tiny_config, train_steps, write_yaml)

SAME_STEPS = 12  # 96 samples, micro 4 x 2 processes


demo_storage = demo_storage_fixture(num_train=96, num_val=16, num_test=8)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory, demo_storage):
    """The same fp32 run on runner_fsdp, ZeRO-2 and ZeRO-3 (each tested several ways below)."""
    root = tmp_path_factory.mktemp("same")
    runs = {}
    for name, runner, stage in (("fsdp", "runner_fsdp", 3), ("zero2", "runner_deepspeed", 2),
                                ("zero3", "runner_deepspeed", 3)):
        out = root / name
        cfg = write_yaml(root / f"{name}.yaml", tiny_config(out, demo_storage, stage, runner=runner,
                                                             test_splits=["test"]))
        runs[name] = (out, run_train(cfg))
    return runs


@pytest.mark.parametrize("deepspeed", ["zero2", "zero3"])
def test_fsdp_takes_the_steps_deepspeed_takes_in_fp32(fp32_runs, deepspeed):
    fsdp, reference = train_steps(fp32_runs["fsdp"][0]), train_steps(fp32_runs[deepspeed][0])
    assert len(fsdp) == len(reference) == SAME_STEPS
    for mine, theirs in zip(fsdp, reference):
        assert mine["lr"] == theirs["lr"]
        assert _relative(mine["loss"], theirs["loss"]) < 1e-5, (mine, theirs)
        assert _relative(mine["grad_norm"], theirs["grad_norm"]) < 1e-5, (mine, theirs)
        # The FLOP function reads the sharded model (and the LLM process 1 built empty) as the whole one.
        assert _relative(mine["tflops_per_device"] / mine["tokens_per_sec"],
                         theirs["tflops_per_device"] / theirs["tokens_per_sec"]) < 1e-9, (mine, theirs)
    assert fsdp[-1]["loss"] < 0.8 * fsdp[0]["loss"]


def test_cpu_offload_and_keeping_gathered_parameters_take_the_default_steps(fp32_runs, tmp_path, demo_storage):
    """run.fsdp.cpu_offload and reshard_after_forward=false change where parameters live and when they are gathered,
    not the arithmetic: the same steps as the default run (both in one run, to keep the suite short)."""
    out = tmp_path / "options"
    run_train(write_yaml(tmp_path / "options.yaml", tiny_config(
        out, demo_storage, runner="runner_fsdp", fsdp={"cpu_offload": True, "reshard_after_forward": False})))
    assert_same_steps(out, fp32_runs["fsdp"][0], range(1, SAME_STEPS + 1), 1e-6)


def test_fsdp_generates_under_sharding_what_deepspeed_generates(fp32_runs):
    """Greedy answers on the test split, each rank a shard of it, every rank stepping until all are done."""
    def test_line(out):
        return next(m for m in metrics(out) if m.get("split") == "test")

    fsdp, zero3 = test_line(fp32_runs["fsdp"][0]), test_line(fp32_runs["zero3"][0])
    assert fsdp["exact_match"] == zero3["exact_match"]
    assert [s["generated"] for s in fsdp["samples"]] == [s["generated"] for s in zero3["samples"]]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_frozen_towers_lora_and_gradient_checkpointing_under_fsdp(tmp_path, demo_storage, dtype):
    """The MiniGPT4Qwen split (frozen ViT and LLM) with LoRA on the LLM and both recomputation switches: the
    same steps as DeepSpeed's, and a checkpoint that holds exactly the trainable parameters. In bf16 the
    frozen weights are stored in bf16 (as DeepSpeed casts them), the trainable ones in fp32."""
    from torch.distributed.checkpoint import FileSystemReader

    from lavis_ds.build import build_model
    from lavis_ds.config import load_config

    losses, flops_per_token = {}, {}
    for runner in ("runner_fsdp", "runner_deepspeed"):
        cfg = tiny_config(tmp_path / runner, demo_storage, runner=runner, dtype=dtype)
        cfg["model"].update(freeze_vit=True, freeze_llm=True, get_lora=True, use_grad_checkpoint=True,
                            llm_grad_checkpoint=True)
        path = write_yaml(tmp_path / f"{runner}.yaml", cfg)
        run_train(path)
        losses[runner] = [m["loss"] for m in train_steps(tmp_path / runner)]
        flops_per_token[runner] = [m["tflops_per_device"] / m["tokens_per_sec"] for m in train_steps(tmp_path / runner)]
    tolerance = 1e-5 if dtype == "fp32" else 0.02  # bf16: see test_bf16_mixed_fsdp_stays_close_to_deepspeed_bf16
    assert all(_relative(a, b) < tolerance for a, b in zip(losses["runner_fsdp"], losses["runner_deepspeed"])), losses
    assert losses["runner_fsdp"][-1] < losses["runner_fsdp"][0]
    # Frozen towers and LoRA adapters counted alike under both engines (the same samples: the same FLOPs).
    assert flops_per_token["runner_fsdp"] == pytest.approx(flops_per_token["runner_deepspeed"], rel=1e-9)

    model = build_model(load_config(path, world_size=2).model, seed=7)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in name for name in trainable) and not any(name.startswith("visual_encoder") for name in trainable)
    metadata = FileSystemReader(str(tmp_path / "runner_fsdp" / "checkpoints" / f"step_{SAME_STEPS}")).read_metadata()
    saved = {key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")}
    assert saved == trainable


def test_evaluate_only_scores_a_checkpoint_and_trains_nothing(fp32_runs, tmp_path, demo_storage):
    """`run.evaluate: true` with `run.resume` naming a checkpoint: validation and test lines at its step, nothing
    trained or saved, and the test scores the training run logged for that checkpoint."""
    trained = fp32_runs["fsdp"][0]
    out = tmp_path / "evaluated"
    run_train(write_yaml(tmp_path / "evaluate.yaml", tiny_config(
        out, demo_storage, runner="runner_fsdp", valid_splits=["val"], test_splits=["test"], evaluate=True,
        resume=str(trained / "checkpoints" / f"step_{SAME_STEPS}"))))
    lines = metrics(out)
    assert [(m.get("split"), m["step"]) for m in lines] == [("val", SAME_STEPS), ("test", SAME_STEPS)]
    logged = next(m for m in metrics(trained) if m.get("split") == "test")
    assert lines[1]["exact_match"] == logged["exact_match"] and lines[1]["samples"] == logged["samples"]
    assert not list(out.glob("checkpoints/step_*"))


def test_fsdp_checkpoint_is_a_lean_dcp_folder_with_the_protocol(fp32_runs):
    out, proc = fp32_runs["fsdp"]
    tag_dir = out / "checkpoints" / f"step_{SAME_STEPS}"
    marker = json.loads((tag_dir / "lavis_ds_complete.json").read_text())
    assert marker["runner"] == "runner_fsdp" and marker["format"] == "torch.distributed.checkpoint"
    assert {"world_size": 2, "global_batch": 8}.items() <= marker.items()
    files = {p.name for p in tag_dir.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "client_state.pt", "rng_state_rank0.pt",
            "rng_state_rank1.pt", "lavis_ds_complete.json"} <= files
    # the run names a ZeRO stage (tiny_config's run.zero_stage), which FSDP does not read: one line says so
    assert "run.zero_stage=3: read by runner_deepspeed only; runner_fsdp does not use it" in proc.stderr + proc.stdout


def test_export_reads_an_fsdp_checkpoint_as_it_reads_a_deepspeed_one(fp32_runs, tmp_path):
    """The same run exported from FSDP2 and from ZeRO-3: the same trained tensors (to the runs' agreement)."""
    import torch
    from safetensors.torch import load_file

    from lavis_ds.apps.export import WEIGHTS_FILE, export_checkpoint, load_exported

    exported = {name: export_checkpoint(fp32_runs[name][0], tmp_path / name) for name in ("fsdp", "zero3")}
    fsdp, zero3 = (load_file(str(exported[name] / WEIGHTS_FILE)) for name in ("fsdp", "zero3"))
    assert fsdp.keys() == zero3.keys() and len(fsdp) > 10
    for name in fsdp:
        # atol: an attention key bias has a zero gradient in exact arithmetic (softmax ignores a constant
        # per query), so Adam turns rounding noise into steps of lr size there: such biases agree only to
        # ~1e-4 between any two engines. Everything else agrees to ~1e-6.
        torch.testing.assert_close(fsdp[name], zero3[name], rtol=1e-4, atol=2e-4)
    model = load_exported(exported["fsdp"])
    assert not any(hasattr(p, "device_mesh") for p in model.parameters())  # plain tensors, no DTensor left


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fsdp_killed_run_continues_bit_for_bit(tmp_path, dtype):
    storage = tmp_path / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=64, num_val=16, num_test=8))
    killed_run_continues_bit_for_bit(tmp_path, storage, 3, dtype, runner="runner_fsdp")


def test_fsdp_resumes_on_one_process_what_two_saved(tmp_path, demo_storage):
    """DCP reshards the 2-process checkpoint for 1 process; the global batch is kept (accumulation doubles)."""
    def config(out):
        return _without_dropout(tiny_config(out, demo_storage, runner="runner_fsdp", max_epoch=2))

    reference_out, out = tmp_path / "reference", tmp_path / "continued"
    run_train(write_yaml(tmp_path / "reference.yaml", config(reference_out)))
    saved = reference_out / "checkpoints" / f"step_{SAME_STEPS}"  # the end of epoch 0, saved by 2 processes
    rerun = continue_from(saved, write_yaml(tmp_path / "continued.yaml", config(out)), out, nproc=0)
    assert f"resumed from {out / 'checkpoints' / saved.name}" in rerun.stdout
    # Reductions over 1 process add in another order than over 2: equal up to rounding, not bit for bit.
    assert_same_steps(out, reference_out, range(SAME_STEPS + 1, 2 * SAME_STEPS + 1), 1e-5)


def _without_dropout(cfg: dict) -> dict:
    """Dropout masks are drawn per rank, which a change of the number of processes changes."""
    cfg["model"]["qformer"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return cfg


def test_bf16_mixed_fsdp_stays_close_to_deepspeed_bf16(tmp_path, demo_storage):
    runs = {}
    for name, runner in (("fsdp", "runner_fsdp"), ("zero2", "runner_deepspeed")):
        out = tmp_path / name
        run_train(write_yaml(tmp_path / f"{name}.yaml", tiny_config(out, demo_storage, runner=runner, dtype="bf16")))
        runs[name] = [m["loss"] for m in train_steps(out)]
    assert all(math.isfinite(x) for x in runs["fsdp"])
    worst = max(_relative(a, b) for a, b in zip(runs["fsdp"], runs["zero2"]))
    # Both compute in bf16 from fp32 master weights but round in different places (DeepSpeed keeps bf16
    # weights beside its fp32 masters, FSDP casts at each all-gather). Measured over 20 such steps: 0.8%
    # at worst (docs/benchmarks.md); the bound leaves room for other seeds and CPUs.
    assert worst < 0.02, (worst, runs)


def test_fsdp_refuses_fp16_a_bad_option_and_a_deepspeed_checkpoint(tmp_path, demo_storage):
    bad = write_yaml(tmp_path / "bad.yaml", tiny_config(tmp_path / "bad", demo_storage, runner="runner_fsdp",
                                                        dtype="fp16", fsdp={"precision_mod": "low"}))
    proc = run_train(bad, nproc=0, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "run.precision: fp16 is not supported by runner_fsdp" in proc.stderr
    assert "run.fsdp.precision_mod: unknown key; did you mean 'precision_mode'?" in proc.stderr

    # Engines: ZeRO-0 keeps no per-parameter moments to carry over, whichever side of the switch it is on.
    for writer, reader, stage, message in (
            ("runner_deepspeed", "runner_fsdp", 0, "was saved by runner_deepspeed with ZeRO stage 0 (no per-parameter "
                                                   "optimizer states to carry over)"),
            ("runner_fsdp", "runner_deepspeed", 0, "was written by runner_fsdp, and runner_deepspeed with ZeRO stage 0 "
                                                   "cannot continue it")):
        out = tmp_path / writer
        run_train(write_yaml(tmp_path / f"{writer}.yaml", tiny_config(out, demo_storage, stage, runner=writer)), nproc=0)
        proc = run_train(write_yaml(tmp_path / f"{reader}.yaml", tiny_config(out, demo_storage, stage, runner=reader,
                                                                          max_epoch=2)), nproc=0, check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert message in proc.stderr and "run.resume=false" in proc.stderr
        assert (out / "checkpoints" / f"step_{SAME_STEPS * 2}").is_dir()  # refused, not set aside as damaged


# fp32 on 2 processes: process 0 reads the handover and sends every other process its shards (exact to 1e-5).
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted runs the switching tests continue, each made once: ``run(name, config)`` with ``config``
    the run's config for an output folder; returns that folder."""
    root = tmp_path_factory.mktemp("uninterrupted")

    def run(name: str, config: Callable[[Path], dict]) -> Path:
        out = root / name
        if not out.exists():
            run_train(write_yaml(root / f"{name}.yaml", config(out)))
        return out
    return run


@pytest.mark.parametrize("dtype, nproc, back_to_stage", [("fp32", 1, 3), ("fp32", 2, 2), ("bf16", 2, 1)])
def test_a_run_switches_to_fsdp_and_back_to_deepspeed(tmp_path, demo_storage, uninterrupted, dtype, nproc,
                                                      back_to_stage):
    """Checkpointed by runner_deepspeed (ZeRO-2, 2 processes) after epoch 0, continued by runner_fsdp for epoch 1
    (fp32: on 1 process), and by runner_deepspeed again for epoch 2 (fp32: ZeRO-3; bf16: ZeRO-1, DeepSpeed's BF16
    optimizer): the fp32 weights and Adam moments carry over each time, and every continued step's loss is the
    uninterrupted DeepSpeed run's."""
    def config(out, runner, stage=2, epochs=3):  # a schedule that does not depend on max_epoch: runs of 2 and 3 epochs
        return _without_dropout(tiny_config(out, demo_storage, stage, runner=runner, dtype=dtype, max_epoch=epochs,
                                        lr_sched="linear_warmup_step_lr", lr_decay_rate=0.5))

    fsdp_out, back_out = tmp_path / "fsdp", tmp_path / "back"
    reference_out = uninterrupted(f"deepspeed_{dtype}", lambda out: config(out, "runner_deepspeed"))
    # fp32: the same arithmetic up to summation order; bf16: the engines round differently (see above).
    tolerance = 1e-5 if dtype == "fp32" else 0.02

    saved = reference_out / "checkpoints" / f"step_{SAME_STEPS}"
    proc = continue_from(saved, write_yaml(tmp_path / "fsdp.yaml", config(fsdp_out, "runner_fsdp", epochs=2)),
                         fsdp_out, nproc=nproc)
    assert f"resumed runner_deepspeed's checkpoint {fsdp_out / 'checkpoints' / saved.name} under runner_fsdp" \
        in proc.stdout
    assert_same_steps(fsdp_out, reference_out, range(SAME_STEPS + 1, 2 * SAME_STEPS + 1), tolerance)

    saved = fsdp_out / "checkpoints" / f"step_{2 * SAME_STEPS}"
    assert json.loads((saved / "lavis_ds_complete.json").read_text())["runner"] == "runner_fsdp"
    proc = continue_from(saved, write_yaml(tmp_path / "back.yaml", config(back_out, "runner_deepspeed", back_to_stage)),
                         back_out)
    assert f"resumed runner_fsdp's checkpoint {back_out / 'checkpoints' / saved.name} under runner_deepspeed" \
        in proc.stdout
    assert_same_steps(back_out, reference_out, range(2 * SAME_STEPS + 1, 3 * SAME_STEPS + 1), tolerance)
    for out in (fsdp_out, back_out):
        assert not any((out / "checkpoints" / "universal").iterdir())  # the conversions were scratch
