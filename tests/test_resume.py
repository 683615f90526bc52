"""Resumption on real DeepSpeed engines, 2 processes: SIGKILL at any moment, rerun, and nothing changes."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from conftest import demo_storage_fixture
from run_utils import (EPOCHS, SAVE_EVERY, STEPS_PER_EPOCH, kill, killed_run_continues_bit_for_bit, noisy_config,
                       run_train, start, tiny_config, train_steps, write_yaml)


demo_storage = demo_storage_fixture(num_train=64, num_val=16, num_test=8)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_killed_run_continues_bit_for_bit(tmp_path, demo_storage, stage, dtype):
    expected = killed_run_continues_bit_for_bit(tmp_path, demo_storage, stage, dtype)
    losses = [loss for _, _, loss, _, _ in expected]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) < 0.9 * sum(losses[:3])


# ---- crash while saving ----------------------------------------------------------------------------

def test_kill_while_saving_resumes_from_the_previous_checkpoint(tmp_path, demo_storage):
    """SIGKILL a run inside ``save()``: every rank has written its DeepSpeed files, the marker is not there yet.

    A FIFO where rank 0 writes the marker's temporary file blocks that write (a FIFO
    opens for writing only when someone reads), which holds the run at the most
    dangerous moment of a save long enough to kill it there.
    """
    out = tmp_path / "torn"
    total = STEPS_PER_EPOCH * EPOCHS
    torn = out / "checkpoints" / f"step_{2 * SAVE_EVERY}"
    torn.mkdir(parents=True)
    os.mkfifo(torn / "lavis_ds_complete.json.tmp")
    cfg = write_yaml(tmp_path / "torn.yaml", noisy_config(out, demo_storage, 2, "fp32", keep_last=2))
    proc = start(cfg)
    deadline = time.time() + 300
    while not (torn / "rng_state_rank1.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert (torn / "rng_state_rank1.pt").exists(), "the run did not reach the save of step 6 in time"
    time.sleep(1.0)
    assert proc.poll() is None, "the run ended instead of blocking in save()"
    kill(proc)
    assert (torn / "mp_rank_00_model_states.pt").exists() and not (torn / "lavis_ds_complete.json").exists()
    previous = STEPS_PER_EPOCH  # saved at the end of epoch 0, the newest complete one before step 6
    assert (out / "checkpoints" / f"step_{previous}" / "lavis_ds_complete.json").exists()

    rerun = run_train(cfg)
    assert f"discarded the incomplete checkpoint {torn}" in rerun.stdout
    assert f"resumed from {out / 'checkpoints' / f'step_{previous}'}" in rerun.stdout
    assert [m["step"] for m in train_steps(out)] == list(range(1, total + 1))
    # keep_last=2: the two newest complete checkpoints remain; step 6 was saved again, completely, and pruned.
    assert {p.name for p in (out / "checkpoints").glob("step_*")} == {f"step_{total - 3}", f"step_{total}"}


def test_resume_refuses_a_path_to_an_incomplete_checkpoint(tmp_path, demo_storage):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_5").mkdir(parents=True)
    (out / "checkpoints" / "step_5" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    cfg = write_yaml(tmp_path / "run.yaml", noisy_config(out, demo_storage, 2, "fp32",
                                                          resume=str(out / "checkpoints" / "step_5")))
    proc = run_train(cfg, nproc=0, check=False)
    assert proc.returncode != 0
    assert "holds no complete lavis_ds checkpoint" in proc.stderr


# ---- lean checkpoints ---------------------------------------------------------------------------------

def _tensors(obj, prefix=""):
    """(name, tensor) for every tensor inside a loaded checkpoint file."""
    import torch

    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32")])
def test_checkpoint_holds_no_frozen_tensor_and_has_the_expected_size(tmp_path, demo_storage, stage, dtype):
    import torch

    from lavis_ds.build import build_model
    from lavis_ds.config import load_config

    out = tmp_path / "lean"
    cfg = tiny_config(out, demo_storage, stage=stage, dtype=dtype, max_epoch=1, save_freq_steps=0)
    cfg["model"].update(freeze_vit=True, freeze_llm=True)  # the MiniGPT4Qwen split: Q-Former + projection train
    path = write_yaml(tmp_path / "lean.yaml", cfg)
    run_train(path)

    model = build_model(load_config(path, world_size=2).model, seed=7)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and frozen
    tag_dir = out / "checkpoints" / f"step_{64 // 8}"
    saved_names = set()
    for file in tag_dir.glob("*.pt"):
        for name, _ in _tensors(torch.load(file, map_location="cpu", weights_only=False)):
            saved_names.add(name)
    assert not any(name.endswith(f".{f}") or name == f for name in saved_names for f in frozen)
    assert {f"module.{n}" for n in trainable} <= saved_names

    numel = sum(model.get_parameter(n).numel() for n in trainable)
    param_bytes = 2 if dtype == "bf16" else 4
    # The weights in their training dtype + Adam's fp32 state: master copy, exp_avg, exp_avg_sq.
    need = numel * (param_bytes + 12)
    size = sum(f.stat().st_size for f in tag_dir.iterdir())
    assert size <= 1.1 * need, f"{size} bytes on disk for {numel} trainable parameters (need {need})"
    assert size >= numel * 8  # the optimizer state is there


def test_prune_keeps_the_newest_and_the_one_named(tmp_path):
    """keep_last=2 plus the checkpoint the BestCheckpoint hook names (its choice: tests/test_eval_training.py)."""
    from lavis_ds.runners import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "weights.pt").write_bytes(b"x")
        ckpt.mark_complete(root / f"step_{step}", {"global_step": step})
    (root / "step_7").mkdir()  # a save that a crash cut short
    (root / ".deleting-step_1").mkdir()  # a deletion that a crash cut short

    ckpt.prune(root, keep_last=2, keep=root / "step_4")
    assert sorted(p.name for p in root.iterdir()) == ["step_10", "step_4", "step_8"]


# ---- elastic resume ------------------------------------------------------------------------------------

def _elastic_config(out: Path, demo_storage: Path, micro: int, accum: int) -> dict:
    """Augmentation on (a function of the sample, so of nothing the world size changes); dropout off."""
    cfg = tiny_config(out, demo_storage, stage=2, micro=micro, accum=accum, max_epoch=2, save_freq_steps=3)
    cfg["model"]["qformer"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return cfg


@pytest.fixture(scope="module")
def elastic_references(tmp_path_factory, demo_storage):
    """The same global batch of 8 run uninterrupted on 2 processes (4 x 1 x 2) and on 1 (4 x 2 x 1)."""
    root = tmp_path_factory.mktemp("elastic")
    runs = {}
    for nproc, accum in ((2, 1), (1, 2)):
        out = root / f"world{nproc}"
        run_train(write_yaml(root / f"world{nproc}.yaml", _elastic_config(out, demo_storage, 4, accum)),
                  nproc=nproc if nproc > 1 else 0)
        runs[nproc] = out
    return runs


def _continue_on(tmp_path, demo_storage, source: Path, nproc: int, micro: int = 4, accum: int = 1, check=True):
    """Copy step_6 of ``source`` into a fresh run folder and resume it there on ``nproc`` processes."""
    import shutil

    out = tmp_path / "continued"
    shutil.copytree(source / "checkpoints" / "step_6", out / "checkpoints" / "step_6")
    cfg = write_yaml(tmp_path / "continued.yaml", _elastic_config(out, demo_storage, micro, accum))
    proc = run_train(cfg, nproc=nproc if nproc > 1 else 0, check=check)
    return out, proc


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_processes_continues_the_curve(tmp_path, demo_storage, elastic_references,
                                                                   before, after):
    reference = train_steps(elastic_references[before])
    # The two layouts see the same samples per step: their curves agree to float precision.
    other = train_steps(elastic_references[after])
    assert [m["loss"] for m in other] == pytest.approx([m["loss"] for m in reference], rel=1e-4)

    # The config asks for accumulation 1; resuming keeps the saved global batch of 8 instead.
    out, proc = _continue_on(tmp_path, demo_storage, elastic_references[before], after)
    assert "resumed from" in proc.stdout
    continued = train_steps(out)
    assert [m["step"] for m in continued] == list(range(7, len(reference) + 1))
    assert [m["lr"] for m in continued] == [m["lr"] for m in reference[6:]]
    assert [m["loss"] for m in continued] == pytest.approx([m["loss"] for m in reference[6:]], rel=1e-4)
    assert [m["grad_norm"] for m in continued] == pytest.approx([m["grad_norm"] for m in reference[6:]], rel=1e-3)
    # The universal copy was scratch for that one load: nothing of it stays on disk.
    universal = out / "checkpoints" / "universal"
    assert universal.is_dir() and not any(universal.iterdir())


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused(tmp_path, demo_storage, elastic_references):
    # Saved by 1 process with a global batch of 8; micro-batches of 8 on 2 processes would make 16.
    _, proc = _continue_on(tmp_path, demo_storage, elastic_references[1], 2, micro=8, check=False)
    assert proc.returncode != 0
    assert "a global batch of 8 cannot be split into micro-batches of 8 on 2 processes" in proc.stderr
    assert "process counts that keep it: 1" in proc.stderr


@pytest.mark.parametrize("engine_file, writer", [("mp_rank_00_model_states.pt", "runner_deepspeed"),
                                                 (".metadata", "runner_fsdp")])
def test_a_checkpoint_is_known_by_its_engine_files_when_its_marker_names_no_engine(tmp_path, engine_file, writer):
    """Markers written before they named their engine: the folder's files say which engine wrote it."""
    from lavis_ds.runners import checkpoint as ckpt

    tag_dir = tmp_path / "step_4"
    tag_dir.mkdir()
    assert not ckpt.looks_like_checkpoint(tag_dir)
    (tag_dir / engine_file).write_bytes(b"")
    assert ckpt.looks_like_checkpoint(tag_dir)
    ckpt.mark_complete(tag_dir, {"global_step": 4, "epoch": 0, "world_size": 1, "global_batch": 4})
    assert ckpt.writer_of(tag_dir) == writer
    ckpt.mark_complete(tag_dir, {"global_step": 4, "runner": "my_runner"})
    assert ckpt.writer_of(tag_dir) == "my_runner"  # the marker's word wins


def test_a_marker_naming_no_engine_beside_no_engine_files_is_damaged(tmp_path):
    from lavis_ds.runners import checkpoint as ckpt

    ckpt.mark_complete(tmp_path, {"global_step": 4})
    with pytest.raises(ckpt.DamagedCheckpoint, match="names no engine and the folder holds no registered engine's"):
        ckpt.writer_of(tmp_path)
