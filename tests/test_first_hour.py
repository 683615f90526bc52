"""What a newcomer meets in the first hour: ops compiled once per environment, a changed ZeRO stage or
precision on the same output folder, a rerun of a finished run, warnings that fire on every step."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import demo_storage_fixture
from lavis_ds.common.extensions import configure_build_environment
from run_utils import run_train, tiny_config, train_steps, write_yaml

STEPS_PER_EPOCH = 32 // (4 * 2)  # 32 samples, micro 4 x 2 processes


demo_storage = demo_storage_fixture(num_train=32, num_val=8, num_test=8)


@pytest.fixture(scope="module")
def stage2_two_epochs(tmp_path_factory, demo_storage):
    """The uninterrupted reference: ZeRO-2, fp32, two epochs."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run_train(write_yaml(out.parent / "run.yaml", tiny_config(out, demo_storage, 2, max_epoch=2)))
    return out


def _cut_after_first_epoch(reference: Path, out: Path) -> None:
    """``out``: the reference run as it was when its first epoch's checkpoint had just been written."""
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / f"step_{2 * STEPS_PER_EPOCH}")
    (out / "finished.json").unlink()


def test_a_changed_zero_stage_resumes_through_the_universal_checkpoint(tmp_path, demo_storage, stage2_two_epochs):
    out = tmp_path / "out"
    _cut_after_first_epoch(stage2_two_epochs, out)
    marker = json.loads((out / "checkpoints" / f"step_{STEPS_PER_EPOCH}" / "lavis_ds_complete.json").read_text())
    assert marker["runner"] == "runner_deepspeed" and marker["zero_stage"] == 2 and marker["precision"] == "fp32"

    # The same output folder, now ZeRO-3: it continues instead of dying in DeepSpeed's loader.
    proc = run_train(write_yaml(tmp_path / "zero3.yaml", tiny_config(out, demo_storage, 3, max_epoch=2)))
    assert "universal checkpoint: zero_stage 2 -> 3" in proc.stdout
    continued = train_steps(out)
    reference = train_steps(stage2_two_epochs)
    assert [m["step"] for m in continued] == [m["step"] for m in reference]
    # fp32 master weights and Adam moments carried over: the curve goes on where it was (ZeRO-3 adds in
    # another order, so equal within float tolerance, not bit for bit). Each parameter group keeps its own
    # weight decay: ZeRO-3's universal load gave every group the first one's.
    for ours, theirs in zip(continued[STEPS_PER_EPOCH:], reference[STEPS_PER_EPOCH:]):
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-9)
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert not (out / "checkpoints" / "universal" / f"step_{STEPS_PER_EPOCH}").exists()  # scratch copy gone

    # And back: the ZeRO-3 checkpoint it just wrote resumes under ZeRO-2 in bf16 (stage and precision change).
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS_PER_EPOCH}")
    (out / "finished.json").unlink()
    proc = run_train(write_yaml(tmp_path / "bf16.yaml", tiny_config(out, demo_storage, 2, dtype="bf16", max_epoch=3)))
    assert "zero_stage 3 -> 2 and precision fp32 -> bf16" in proc.stdout
    after = train_steps(out)
    assert [m["step"] for m in after] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    assert all(m["loss"] == m["loss"] and m["loss"] < after[0]["loss"] for m in after[2 * STEPS_PER_EPOCH:])


def test_a_stage_change_that_cannot_convert_stops_with_what_to_do(tmp_path, demo_storage, stage2_two_epochs):
    out = tmp_path / "out"
    shutil.copytree(stage2_two_epochs, out)
    before = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    # One plain process: what the user reads is train.py's own output, not torchrun's report of a failed child.
    proc = run_train(write_yaml(tmp_path / "zero0.yaml", tiny_config(out, demo_storage, 0, max_epoch=3)), nproc=0,
                     check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "was saved with ZeRO stage 2 in fp32 and this run asks for stage 0 in fp32" in proc.stderr
    assert "run.resume=false" in proc.stderr
    assert before == {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}


def test_a_rerun_of_a_finished_run_says_so_and_adds_nothing(tmp_path, demo_storage, stage2_two_epochs):
    out = tmp_path / "out"
    shutil.copytree(stage2_two_epochs, out)
    # The reference run used the default config path; rerun it exactly, test split included.
    cfg = write_yaml(tmp_path / "rerun.yaml", tiny_config(out, demo_storage, 2, max_epoch=2))
    before = (out / "metrics.jsonl").read_text()
    proc = run_train(cfg)
    assert f"already finished at step {2 * STEPS_PER_EPOCH}" in proc.stdout
    assert (out / "metrics.jsonl").read_text() == before

    # Training longer is not a rerun: it goes on from the last checkpoint.
    run_train(write_yaml(tmp_path / "longer.yaml", tiny_config(out, demo_storage, 2, max_epoch=3)))
    assert [m["step"] for m in train_steps(out)][-1] == 3 * STEPS_PER_EPOCH


def test_zero3_deprecation_warnings_show_once_per_process(tmp_path, demo_storage):
    out = tmp_path / "out"
    proc = run_train(write_yaml(tmp_path / "z3.yaml", tiny_config(out, demo_storage, 3, max_epoch=1)))
    text = proc.stdout + proc.stderr
    # Two processes: one line per process and message (each used to print on every step). Exact: a notice that no
    # longer comes (DeepSpeed moved to the new names) means the filter in lavis_ds.common.logger can go.
    for collective in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        assert text.count(f"`torch.distributed.{collective}` is deprecated") == 2, collective
    assert len(train_steps(out)) == STEPS_PER_EPOCH


def test_one_extensions_folder_and_one_ninja_per_environment(tmp_path, monkeypatch):
    """Whatever the PATH (venv activated or not), the environment's own folder and ninja are used."""
    import ninja as ninja_package

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")  # not activated: a system ninja may come first
    assert configure_build_environment() == Path(sys.prefix) / "torch_extensions"
    assert Path(shutil.which("ninja")).parent == Path(ninja_package.BIN_DIR)
    # A folder the user chose is kept.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert configure_build_environment() == tmp_path / "mine"
