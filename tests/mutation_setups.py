"""What the cases of tests/test_mutations.py are made of: the `Case` record (a bad input, the setup that makes it in
a case folder from the shared material, what the run must answer) and the setups and checks its records name.
The records themselves are data, in tests/test_mutations.py (CASES)."""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import folder_faults
from lavis_ds.datasets.samplers import StepBatchSampler
from run_utils import run_train, tiny_config, train_steps, write_yaml

STEPS = 16  # 64 samples, micro-batch 4, one process
SAVE_EVERY = 4  # the base run leaves step_4, step_8, step_12, step_16


# ---------------------------------------------------------------- what every case must show
def tree_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def complete_checkpoints(out: Path) -> dict[str, dict[str, str]]:
    ckpts = out / "checkpoints"
    return {p.name: tree_hashes(p) for p in ckpts.glob("step_*") if (p / "lavis_ds_complete.json").is_file()} \
        if ckpts.is_dir() else {}


@dataclass(frozen=True)
class Material:
    """What the cases start from: the demo data, and the base run with four complete checkpoints (beside it,
    ``frozen_vit``: the same run with the ViT frozen)."""
    storage: Path
    base: Path


@dataclass(frozen=True)
class TrainLaunch:
    """train.py with ``nproc`` processes (0: `python train.py`), forked or through the user's launcher (run_train)."""
    cfg: Path
    nproc: int = 0
    options: tuple[str, ...] = ()
    launcher: str = "fork"


@dataclass(frozen=True)
class ExportLaunch:
    """``python export.py <argv>``: its main() in a process forked from the suite's server (export.py's command line
    itself, launched: tests/test_export.py)."""
    argv: tuple[str, ...]


Setup = Callable[[Path, Material], "TrainLaunch | ExportLaunch"]  # prepares the case's folder; returns what to run


@dataclass(frozen=True)
class Case:
    name: str
    setup: Setup
    exit_code: int
    says: list[str]  # regexes the output must match (the file/key/record/step and what is valid)
    untouched: Callable[[Path], list[str]] = lambda root: []  # checkpoint names that must stay byte-identical
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None


def train_cmd(cfg: Path, nproc: int = 0, *options: str, launcher: str = "fork") -> TrainLaunch:
    return TrainLaunch(cfg, nproc, options, launcher)


def export_cmd(source: Path, out: Path) -> ExportLaunch:
    return ExportLaunch((str(source), "--out", str(out)))


# ---------------------------------------------------------------- shared material
def base_config(out: Path, storage: Path, **run) -> dict:
    return tiny_config(out, storage, stage=2, max_epoch=1, **{"save_freq_steps": SAVE_EVERY, **run})


NAN_MODEL = '''
"""A user model whose loss is NaN for one chosen sample: a real divergence at a chosen step."""
import os
import torch
from torch import nn
from lavis_ds.common.registry import registry
from lavis_ds.models.base import BaseModel


@registry.register_model("nan_at_sample")
class NanAtSample(BaseModel):
    PRETRAINED_MODEL_CONFIG_DICT = {"default": os.path.join(os.path.dirname(__file__), "nan_at_sample.yaml")}

    def __init__(self, *, poisoned: int = -1):
        super().__init__()
        self.poisoned = poisoned
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, samples):
        colour = samples["image"].float().mean(dim=(2, 3))
        err = (self.net(colour).float() - colour) ** 2
        poisoned = (samples["index"] == self.poisoned)[:, None]
        err = err * torch.where(poisoned, float("nan"), 1.0)  # NaN loss and NaN gradients from that sample
        return {"loss": err.mean(), "loss_sum": err.sum().detach(), "num_tokens": err.numel()}
'''


def nan_project(folder: Path, storage: Path, out: Path, poisoned: int, nproc: int, **run) -> Path:
    """A run YAML of the NaN model, registered through `imports:` from ``folder``."""
    package = folder / "nan_ext"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "nan_model.py").write_text(textwrap.dedent(NAN_MODEL))
    (package / "nan_at_sample.yaml").write_text("model:\n  arch: nan_at_sample\n")
    return write_yaml(folder / "nan.yaml", {
        "imports": ["nan_ext.nan_model"],
        "model": {"arch": "nan_at_sample", "poisoned": poisoned},
        "datasets": {"demo_shapes": {"build_info": {"storage": str(storage), "num_train": 64, "num_val": 8,
                                                   "num_test": 8}}},
        "run": {"output_dir": str(out), "init_lr": 0.05, "max_epoch": 1, "log_freq": 1, "seed": 3,
                "batch_size_train": 4, "zero_stage": 0, **run},
    })


def sample_at(step: int, rank: int, micro: int = 0, *, nproc: int, seed: int = 3) -> int:
    """The first training sample of (1-based optimizer step, rank, micro-batch) in epoch 0."""
    sampler = StepBatchSampler(64, 4, 1, nproc, rank, seed=seed)
    return sampler.step_indices(step - 1)[micro][0]


def copy_run(base: Path, case_dir: Path, storage: Path, **run) -> tuple[Path, Path]:
    """A copy of the base run and its YAML (with ``run`` overrides); returns (output_dir, yaml)."""
    out = case_dir / "out"
    shutil.copytree(base, out)
    cfg = base_config(out, storage, **run)
    return out, write_yaml(case_dir / "run.yaml", cfg)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def good(*names: str) -> Callable[[Path], list[str]]:
    return lambda d: list(names)


ALL_FOUR = good("step_4", "step_8", "step_12", "step_16")
OLDER = good("step_4", "step_8", "step_12")


# ---------------------------------------------------------------- checkpoints and export
def resume_case(damage: Callable[[Path], None], **run) -> Setup:
    def setup(d: Path, m: Material) -> TrainLaunch:
        out, cfg = copy_run(m.base, d, m.storage, **run)
        damage(out / "checkpoints")
        return train_cmd(cfg)
    return setup


def resume_names_step_16(damage: Callable[[Path], None]) -> Setup:
    """`run.resume` naming the copy's step_16, which ``damage`` has hit."""
    def setup(d: Path, m: Material) -> TrainLaunch:
        out, cfg = copy_run(m.base, d, m.storage, resume=str(d / "out" / "checkpoints" / "step_16"))
        damage(out / "checkpoints" / "step_16")
        return train_cmd(cfg)
    return setup


def resume_tag_step_5(d: Path, m: Material) -> TrainLaunch:
    return train_cmd(copy_run(m.base, d, m.storage, resume_ckpt_load_dir=str(d / "out" / "checkpoints"),
                              resume_ckpt_tag="step_5")[1])


def resumed_with(*options: str) -> Setup:
    """The copy of the base run continued with ``options``."""
    return lambda d, m: train_cmd(copy_run(m.base, d, m.storage)[1], 0, *options)


def falls_back(d: Path, proc) -> None:
    ckpts = d / "out" / "checkpoints"
    assert "resumed from" in proc.stdout and f"{ckpts / 'step_12'} at epoch 0, step 12" in proc.stdout
    assert (ckpts / "step_16.damaged").is_dir()  # set aside, never deleted
    assert [m["step"] for m in train_steps(d / "out")] == list(range(1, STEPS + 1))


def kept_damaged(d: Path, proc) -> None:
    assert (d / "out" / "checkpoints" / "step_16").is_dir()  # named explicitly: nothing renamed or deleted


def grow_or_shrink(grow: bool) -> Setup:
    """The base run trained with the ViT frozen (grow) or everything trainable (shrink: freeze the LLM now)."""
    def setup(d: Path, m: Material) -> TrainLaunch:
        if grow:
            out = d / "out"
            (out / "checkpoints").mkdir(parents=True)
            shutil.copytree(m.base.parent / "frozen_vit" / "checkpoints" / "step_16", out / "checkpoints" / "step_16")
            return train_cmd(write_yaml(d / "run.yaml", base_config(out, m.storage)))
        _, cfg = copy_run(m.base, d, m.storage)
        return train_cmd(cfg, 0, "model.freeze_llm=true")
    return setup


def export_case(damage: Callable[[Path], None] | None = None, source: str = "out") -> Setup:
    def setup(d: Path, m: Material) -> ExportLaunch:
        out = d / "out"
        shutil.copytree(m.base, out)
        if damage:
            damage(out / "checkpoints")
        (d / "plain").mkdir()
        (d / "plain" / "notes.txt").write_text("not a checkpoint")
        return export_cmd(d / source, d / "export")
    return setup


# ---------------------------------------------------------------- data
def data_case(mutate: Callable[[Path, Path, list], dict], nproc: int = 0, **run) -> Setup:
    def setup(d: Path, m: Material) -> TrainLaunch:
        images = d / "images"
        shutil.copytree(m.storage / "images", images)
        records = json.loads((m.storage / "annotations" / "train.json").read_text())[:64]
        section = {"builder": "minigpt4qwen_instruction", **mutate(d, images, records),
                   "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 64},
                                     "eval": {"name": "blip2_image_eval", "image_size": 64}}}
        cfg = base_config(d / "out", m.storage, **run)
        cfg["datasets"] = {"shapes": section}
        return train_cmd(write_yaml(d / "run.yaml", cfg), nproc)
    return setup


def annotations(d: Path, images: Path, records, text: str | None = None) -> dict:
    path = d / "train.json"
    path.write_text(text if text is not None else json.dumps(records))
    return {"build_info": {"annotations": {"train": {"storage": str(path)}}, "images": {"storage": str(images)}}}


def garbage_image(index: int):
    def mutate(d, images, records):
        (images / records[index]["image"]).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0garbage" * 20)
        return annotations(d, images, records)
    return mutate


def record_without(key: str):
    def mutate(d, images, records):
        del records[5][key]
        return annotations(d, images, records)
    return mutate


# ---------------------------------------------------------------- runtime: a NaN loss
def nan_case(on_nonfinite: str, nproc: int, step: int, rank: int, save_freq_steps: int) -> Setup:
    def setup(d: Path, m: Material) -> TrainLaunch:
        poisoned = sample_at(step, rank, nproc=nproc)
        cfg = nan_project(d, m.storage, d / "out", poisoned, nproc, save_freq_steps=save_freq_steps,
                          on_nonfinite=on_nonfinite)
        # The user's package is found from the working directory; 2 processes go through torchrun, whose
        # report of a failed worker comes with ours.
        return train_cmd(cfg, nproc if nproc > 1 else 0, launcher="launch" if nproc > 1 else "fork")
    return setup


def nan_stopped(d: Path, proc) -> None:
    out = d / "out"
    assert sorted(complete_checkpoints(out)) == ["step_2", "step_4"]  # nothing saved at or after the NaN
    assert [m["step"] for m in train_steps(out)] == [1, 2, 3, 4]
    assert proc.stderr.count("non-finite loss at optimizer step 5") == 1  # every rank stops, one says so


def nan_skipped(d: Path, proc) -> None:
    out = d / "out"
    steps = train_steps(out)
    assert [m["step"] for m in steps] == list(range(1, 17))
    assert steps[4]["skipped"] == "nonfinite_loss" and steps[4]["loss"] is None
    assert all(m["loss"] is not None and "skipped" not in m for i, m in enumerate(steps) if i != 4)
    # No parameter update at the skipped step 5: its checkpoint holds the weights and Adam state of step 4.
    saved = {s: torch.load(out / "checkpoints" / f"step_{s}" / "mp_rank_00_model_states.pt",
                           map_location="cpu", weights_only=False) for s in (4, 5, 6)}
    for name, tensor in saved[4]["module"].items():
        assert torch.equal(tensor, saved[5]["module"][name]) and torch.isfinite(tensor).all()
        assert not torch.equal(tensor, saved[6]["module"][name])  # step 6 trained again
    adam = {s: saved[s]["optimizer"]["state"] for s in (4, 5)}
    assert all(torch.equal(adam[4][i]["exp_avg"], adam[5][i]["exp_avg"]) for i in adam[4])
    assert "run.on_nonfinite=skip: this optimizer step is skipped (no parameter update)" in proc.stderr


# ---------------------------------------------------------------- runtime: the output folder
def output_dir_case(make: Callable[[Path], Path]) -> Setup:
    return lambda d, m: train_cmd(write_yaml(d / "run.yaml", base_config(make(d), m.storage)))


def fresh(*options: str) -> Setup:
    return lambda d, m: train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", m.storage)), 0, *options)


def trained_nothing(d: Path, proc) -> None:
    assert not (d / "out" / "metrics.jsonl").exists() and not (d / "out" / folder_faults.LOCK).exists()


def a_file(d: Path) -> Path:
    (d / "taken").write_text("a file")
    return d / "taken"


def under_a_file(d: Path) -> Path:
    (d / "taken").write_text("a file")
    return d / "taken" / "run"


BUSY = folder_faults.BusyFolder()  # the frozen first run of the busy-folder case, until its check ends it


def busy_folder(d: Path, m: Material) -> TrainLaunch:
    long_run = base_config(d / "out", m.storage)
    long_run["run"]["max_epoch"] = 40  # still training when the second run starts (it is frozen meanwhile)
    out, cfg = d / "out", write_yaml(d / "run.yaml", long_run)
    BUSY.setup(cfg, out)
    return train_cmd(cfg, 2)  # the same command again, on 2 processes: rank 0 finds the lock, every rank stops


KILLED_PIDS: dict[Path, int] = {}  # case folder -> the killed run's rank 0, whose lock the case's run takes over


def killed_runs_lock(d: Path, m: Material) -> TrainLaunch:
    cfg = write_yaml(d / "run.yaml", base_config(d / "out", m.storage))
    KILLED_PIDS[d] = folder_faults.leave_a_killed_runs_lock(cfg, d / "out", SAVE_EVERY + 1)
    return train_cmd(cfg)


def took_over(d: Path, proc) -> None:
    assert f"took over {d / 'out' / folder_faults.LOCK} from process {KILLED_PIDS.pop(d)} on host" in proc.stderr
    assert not (d / "out" / folder_faults.LOCK).exists()  # released when the run ended
    assert folder_faults.steps_of(d / "out") == list(range(1, STEPS + 1))


def foreign_lock(d: Path, m: Material) -> TrainLaunch:
    out, cfg = copy_run(m.base, d, m.storage)
    d.joinpath("lock.json").write_text(json.dumps(folder_faults.lock_of_another_host(out)))
    shutil.copy(m.base / "config.yaml", d / "config.yaml.before")
    return train_cmd(cfg)


def foreign_lock_kept(d: Path, proc) -> None:
    assert json.loads((d / "out" / folder_faults.LOCK).read_text()) == json.loads((d / "lock.json").read_text())
    assert (d / "out" / "config.yaml").read_bytes() == (d / "config.yaml.before").read_bytes()


def full_disk(d: Path, m: Material) -> TrainLaunch:
    folder_faults.fill_disk_at(d / "out", 2 * SAVE_EVERY)
    return train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", m.storage)))


def full_disk_fsdp(d: Path, m: Material) -> TrainLaunch:
    folder_faults.fill_disk_at(d / "out", 2 * SAVE_EVERY, "__0_0.distcp")
    return train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", m.storage, runner="runner_fsdp")))


def full_disk_metrics(d: Path, m: Material) -> TrainLaunch:
    (d / "out").mkdir()
    (d / "out" / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC, as on a full disk
    return train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", m.storage)), 2)


def stopped_together(d: Path, proc) -> None:
    """Rank 0 alone fails to write; every rank stops at the next step's agreement, none loses the others."""
    assert "lost contact" not in proc.stdout + proc.stderr


def full_disk_resumes(d: Path, proc) -> None:
    out = d / "out"
    assert sorted(complete_checkpoints(out)) == ["step_4"] and folder_faults.steps_of(out) == list(range(1, 9))
    rerun = run_train(d / "run.yaml", nproc=0, cwd=d)  # space freed: the torn step_8 goes, step_4 goes on
    assert f"discarded the incomplete checkpoint {out / 'checkpoints' / 'step_8'}" in rerun.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_4'} at epoch 0, step 4" in rerun.stdout
    assert folder_faults.steps_of(out) == list(range(1, STEPS + 1))
    assert sorted(complete_checkpoints(out)) == ["step_12", "step_16", "step_4", "step_8"]


@functools.cache
def _fp16_refused() -> bool:
    """Whether DeepSpeed's accelerator here refuses fp16 (this CPU kind: oneDNN has no fp16 kernels for it)."""
    from deepspeed.accelerator import get_accelerator

    return not get_accelerator().is_fp16_supported()
