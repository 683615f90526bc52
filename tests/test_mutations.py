"""One clear answer for every bad input beyond the config: data, checkpoints, runtime faults.

Every case runs the real train.py / export.py in its own process (forked from the suite's server,
tests/forked.py, or through torchrun) on a copy of one shared run, and checks: the exit code (or the documented graceful outcome), no traceback from
lavis_ds's processes, a message naming the file/key/record/step and what would be valid,
and every checkpoint that was complete before still byte-identical. The cases start
together (a few at a time): most of their wall time is Python starting up.
(Config/YAML mutations: tests/test_config_mutations.py.)
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

import folder_faults
from conftest import demo_storage_fixture
from forked import STILL_RUNNING
from lavis_ds.datasets.samplers import StepBatchSampler
from run_utils import output_of, run_forked, run_train, start, tiny_config, tracebacks, train_steps, write_yaml

STEPS = 16  # 64 samples, micro-batch 4, one process
SAVE_EVERY = 4  # the base run leaves step_4, step_8, step_12, step_16
PARALLEL = 4


# ---------------------------------------------------------------- what every case must show
def tree_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def complete_checkpoints(out: Path) -> dict[str, dict[str, str]]:
    ckpts = out / "checkpoints"
    return {p.name: tree_hashes(p) for p in ckpts.glob("step_*") if (p / "lavis_ds_complete.json").is_file()} \
        if ckpts.is_dir() else {}


@dataclass
class Case:
    name: str
    setup: Callable[[Path], TrainLaunch | ExportLaunch]  # prepares the case's folder; returns what to run
    exit_code: int
    says: list[str]  # regexes the output must match (the file/key/record/step and what is valid)
    untouched: Callable[[Path], list[str]] = lambda root: []  # checkpoint names that must stay byte-identical
    check: Callable[[Path, subprocess.CompletedProcess], None] | None = None
    before: dict = field(default_factory=dict)


# ---------------------------------------------------------------- shared material
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutations")


demo_storage = demo_storage_fixture(num_train=64, num_val=8, num_test=8)


def base_config(out: Path, storage: Path, **run) -> dict:
    return tiny_config(out, storage, stage=2, max_epoch=1, **{"save_freq_steps": SAVE_EVERY, **run})


@pytest.fixture(scope="module")
def base_runs(root, demo_storage) -> dict[str, Path]:
    """The runs the cases copy, side by side (each is one process on one thread: two cores, one wait):
    ``base`` with four complete checkpoints, and ``frozen_vit``, the same with the ViT frozen."""
    frozen = base_config(root / "frozen_vit", demo_storage, save_freq_steps=0)
    frozen["model"]["freeze_vit"] = True
    jobs = {name: start(write_yaml(root / f"{name}.yaml", cfg), nproc=0)
            for name, cfg in (("base", base_config(root / "base", demo_storage)), ("frozen_vit", frozen))}
    for name, job in jobs.items():
        assert job.wait(timeout=600) == 0, f"{name}:\n{output_of(job)[-4000:]}"
    return {name: root / name for name in jobs}


@pytest.fixture(scope="module")
def base_run(base_runs) -> Path:
    """One single-process run with four complete checkpoints; every checkpoint case copies it."""
    out = base_runs["base"]
    assert sorted(complete_checkpoints(out)) == ["step_12", "step_16", "step_4", "step_8"]
    return out


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
                "batch_size_train": 4, "zero_stage": 0,
                **run},
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


@dataclass(frozen=True)
class TrainLaunch:
    """train.py with ``nproc`` processes (0: `python train.py`), forked or through the user's launcher (run_train)."""
    cfg: Path
    nproc: int = 0
    options: tuple[str, ...] = ()
    launcher: str = "fork"


def train_cmd(cfg: Path, nproc: int = 0, *options: str, launcher: str = "fork") -> TrainLaunch:
    return TrainLaunch(cfg, nproc, options, launcher)


@dataclass(frozen=True)
class ExportLaunch:
    """``python export.py <argv>``: its main() in a process forked from the suite's server (export.py's command line
    itself, launched: tests/test_export.py)."""
    argv: tuple[str, ...]


def export_cmd(source: Path, out: Path) -> ExportLaunch:
    return ExportLaunch((str(source), "--out", str(out)))


# ---------------------------------------------------------------- the cases
def cases(storage: Path, base: Path) -> list[Case]:
    def resume_case(damage: Callable[[Path], None], **run):
        def setup(d: Path) -> TrainLaunch | ExportLaunch:
            out, cfg = copy_run(base, d, storage, **run)
            damage(out / "checkpoints")
            return train_cmd(cfg)
        return setup

    def falls_back(d: Path, proc) -> None:
        ckpts = d / "out" / "checkpoints"
        assert "resumed from" in proc.stdout and f"{ckpts / 'step_12'} at epoch 0, step 12" in proc.stdout
        assert (ckpts / "step_16.damaged").is_dir()  # set aside, never deleted
        assert [m["step"] for m in train_steps(d / "out")] == list(range(1, STEPS + 1))

    def kept_damaged(d: Path, proc) -> None:
        assert (d / "out" / "checkpoints" / "step_16").is_dir()  # named explicitly: nothing renamed or deleted

    good = lambda *names: (lambda d: list(names))  # noqa: E731
    all_four = good("step_4", "step_8", "step_12", "step_16")
    older = good("step_4", "step_8", "step_12")

    def export_case(damage: Callable[[Path], None] | None = None, source: str = "out"):
        def setup(d: Path) -> TrainLaunch | ExportLaunch:
            out = d / "out"
            shutil.copytree(base, out)
            if damage:
                damage(out / "checkpoints")
            (d / "plain").mkdir()
            (d / "plain" / "notes.txt").write_text("not a checkpoint")
            return export_cmd(d / source, d / "export")
        return setup

    def data_case(mutate: Callable[[Path], dict], nproc: int = 0, **run):
        def setup(d: Path) -> TrainLaunch | ExportLaunch:
            images = d / "images"
            shutil.copytree(storage / "images", images)
            records = json.loads((storage / "annotations" / "train.json").read_text())[:64]
            section = {"builder": "minigpt4qwen_instruction", **mutate(d, images, records),
                       "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 64},
                                         "eval": {"name": "blip2_image_eval", "image_size": 64}}}
            cfg = base_config(d / "out", storage, **run)
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

    def nan_case(on_nonfinite: str, nproc: int, step: int, rank: int, save_freq_steps: int):
        def setup(d: Path) -> TrainLaunch | ExportLaunch:
            poisoned = sample_at(step, rank, nproc=nproc)
            cfg = nan_project(d, storage, d / "out", poisoned, nproc, save_freq_steps=save_freq_steps,
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

    def output_dir_case(make: Callable[[Path], Path]):
        def setup(d: Path) -> TrainLaunch | ExportLaunch:
            cfg = base_config(make(d), storage)
            return train_cmd(write_yaml(d / "run.yaml", cfg))
        return setup

    busy = folder_faults.BusyFolder()

    def busy_folder(d: Path) -> TrainLaunch:
        long_run = base_config(d / "out", storage)
        long_run["run"]["max_epoch"] = 40  # still training when the second run starts (it is frozen meanwhile)
        out, cfg = d / "out", write_yaml(d / "run.yaml", long_run)
        busy.setup(cfg, out)
        return train_cmd(cfg, 2)  # the same command again, on 2 processes: rank 0 finds the lock, every rank stops

    killed_pids: dict[Path, int] = {}

    def killed_runs_lock(d: Path) -> TrainLaunch:
        cfg = write_yaml(d / "run.yaml", base_config(d / "out", storage))
        killed_pids[d] = folder_faults.leave_a_killed_runs_lock(cfg, d / "out", SAVE_EVERY + 1)
        return train_cmd(cfg)

    def took_over(d: Path, proc) -> None:
        assert f"took over {d / 'out' / folder_faults.LOCK} from process {killed_pids.pop(d)} on host" in proc.stderr
        assert not (d / "out" / folder_faults.LOCK).exists()  # released when the run ended
        assert folder_faults.steps_of(d / "out") == list(range(1, STEPS + 1))

    def foreign_lock(d: Path) -> TrainLaunch:
        out, cfg = copy_run(base, d, storage)
        d.joinpath("lock.json").write_text(json.dumps(folder_faults.lock_of_another_host(out)))
        return train_cmd(cfg)

    def foreign_lock_kept(d: Path, proc) -> None:
        assert json.loads((d / "out" / folder_faults.LOCK).read_text()) == json.loads((d / "lock.json").read_text())
        assert (d / "out" / "config.yaml").read_bytes() == (base / "config.yaml").read_bytes()

    def full_disk(d: Path) -> TrainLaunch:
        folder_faults.fill_disk_at(d / "out", 2 * SAVE_EVERY)
        return train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", storage)))

    def full_disk_fsdp(d: Path) -> TrainLaunch:
        folder_faults.fill_disk_at(d / "out", 2 * SAVE_EVERY, "__0_0.distcp")
        return train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", storage, runner="runner_fsdp")))

    def full_disk_metrics(d: Path) -> TrainLaunch:
        (d / "out").mkdir()
        (d / "out" / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC, as on a full disk
        return train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", storage)), 2)

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

    def fresh(*options: str) -> Callable[[Path], TrainLaunch]:
        return lambda d: train_cmd(write_yaml(d / "run.yaml", base_config(d / "out", storage)), 0, *options)

    def trained_nothing(d: Path, proc) -> None:
        assert not (d / "out" / "metrics.jsonl").exists() and not (d / "out" / folder_faults.LOCK).exists()

    def a_file(d: Path) -> Path:
        (d / "taken").write_text("a file")
        return d / "taken"

    def under_a_file(d: Path) -> Path:
        (d / "taken").write_text("a file")
        return d / "taken" / "run"

    return [
        # -- data
        Case("corrupt image in a DataLoader worker, 2 processes", data_case(garbage_image(sample_at(2, 1, nproc=2, seed=7)),
             nproc=2, num_workers=2), 2,
             [r"lavis_ds: .*train\.json: record \d+ \(image 'train_\d+\.png'\): cannot read image file "
              r".*train_\d+\.png"]),
        Case("corrupt image, no workers", data_case(garbage_image(sample_at(3, 0, nproc=1, seed=7))), 2,
             [r"lavis_ds: .*record \d+ \(image 'train_\d+\.png'\): cannot read image file"]),
        Case("annotation file is not JSON", data_case(lambda d, i, r: annotations(d, i, r, "[{\"image\": ")), 2,
             [r"train\.json: not valid JSON"]),
        Case("record without output", data_case(record_without("output")), 2,
             [r"train\.json: record 5: missing key\(s\) 'output'"]),
        Case("record whose image is missing", data_case(lambda d, i, r: (
            (i / r[7]["image"]).unlink(), annotations(d, i, r))[1]), 2,
             [r"train\.json: record 7 \(image 'train_00007\.png'\): image file .* not found", "skip_bad_records"]),
        # -- checkpoints, `run.resume: auto`: name the file, fall back, set the damaged one aside
        Case("truncated model states (auto)", resume_case(lambda c: truncate(c / "step_16" / "mp_rank_00_model_states.pt")),
             0, [r"step_16/mp_rank_00_model_states\.pt: unreadable .*truncated", r"set aside as .*step_16\.damaged"],
             older, falls_back),
        Case("truncated optimizer states (auto)", resume_case(
            lambda c: truncate(c / "step_16" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")),
             0, [r"step_16/zero_pp_rank_0_mp_rank_00_optim_states\.pt: unreadable"], older, falls_back),
        Case("garbage rng file (auto)", resume_case(lambda c: (c / "step_16" / "rng_state_rank0.pt").write_text("x")),
             0, [r"step_16/rng_state_rank0\.pt: unreadable"], older, falls_back),
        Case("missing rng file (auto)", resume_case(lambda c: (c / "step_16" / "rng_state_rank0.pt").unlink()),
             0, [r"step_16/rng_state_rank0\.pt: file missing"], older, falls_back),
        Case("marker is not JSON (auto)", resume_case(lambda c: (c / "step_16" / "lavis_ds_complete.json").write_text("{")),
             0, [r"step_16/lavis_ds_complete\.json: unreadable completion marker"], older, falls_back),
        Case("marker is JSON but not a marker (auto)", resume_case(
            lambda c: (c / "step_16" / "lavis_ds_complete.json").write_text("[]")),
             0, [r"lavis_ds_complete\.json: not a lavis_ds completion marker"], older, falls_back),
        Case("every checkpoint damaged", resume_case(lambda c: [truncate(p) for p in c.glob("step_*/mp_rank_00_*")]),
             2, [r"run\.resume=auto: no readable complete checkpoint", r"run\.resume=false"]),
        # -- checkpoints named explicitly: stop, touch nothing
        Case("run.resume names a truncated checkpoint", lambda d: (lambda out_cfg: (
            truncate(out_cfg[0] / "checkpoints" / "step_16" / "mp_rank_00_model_states.pt"),
            train_cmd(out_cfg[1]))[1])(copy_run(base, d, storage, resume=str(d / "out" / "checkpoints" / "step_16"))),
             2, [r"run\.resume=.*step_16: .*mp_rank_00_model_states\.pt: unreadable", "run.resume=auto"],
             older, kept_damaged),
        Case("run.resume names a torn checkpoint", lambda d: (lambda out_cfg: (
            (out_cfg[0] / "checkpoints" / "step_16" / "lavis_ds_complete.json").unlink(),
            train_cmd(out_cfg[1]))[1])(copy_run(base, d, storage, resume=str(d / "out" / "checkpoints" / "step_16"))),
             2, [r"step_16 is an incomplete checkpoint .*no lavis_ds_complete\.json",
                 r"the newest complete one beside it is .*step_12"], older, kept_damaged),
        Case("run.resume names nothing", resume_case(lambda c: None, resume="/nonexistent/step_3"), 2,
             [r"run\.resume: checkpoint folder '/nonexistent/step_3' does not exist"], all_four),
        Case("resume_ckpt_tag names a missing tag", lambda d: train_cmd(copy_run(
            base, d, storage, resume_ckpt_load_dir=str(d / "out" / "checkpoints"), resume_ckpt_tag="step_5")[1]), 2,
             # translated into run.resume (lavis_compat), which the config check finds missing
             [r"run\.resume: checkpoint folder '.*checkpoints/step_5' does not exist"], all_four),
        # -- errors during resume: the checkpoint does not fit the model or the engine
        Case("trainable set grew", lambda d: _grow_or_shrink(d, base, storage, grow=True), 2,
             [r"parameter\(s\) train now but were not trained in the checkpoint: visual_encoder\.", "freeze_"],
             all_four),
        Case("trainable set shrank", lambda d: _grow_or_shrink(d, base, storage, grow=False), 2,
             [r"parameter\(s\) trained in the checkpoint are frozen now: .*llm_model\.", "run.resume=false"],
             all_four),
        # (Stages 1-3 and fp32/bf16 convert through the universal checkpoint: tests/test_first_hour.py.)
        Case("ZeRO stage changed to one that cannot convert", lambda d: train_cmd(
            copy_run(base, d, storage)[1], 0, "run.zero_stage=0"), 2,
             [r"step_16 was saved with ZeRO stage 2 in fp32 and this run asks for stage 0 in fp32",
              r"run\.resume=false"], all_four),
        Case("precision changed to one that cannot convert", lambda d: train_cmd(
            copy_run(base, d, storage)[1], 0, "run.precision=fp16"), 2,
             [r"saved with ZeRO stage 2 in fp32 and this run asks for stage 2 in fp16",
              "between fp32 and bf16 only"], all_four),
        # -- export
        Case("export a folder that is no checkpoint", export_case(source="plain"), 2,
             [r"lavis_ds: .*plain is not a lavis_ds checkpoint", r"checkpoints/step_<N>"], all_four),
        Case("export a truncated model states file", export_case(
            lambda c: truncate(c / "step_16" / "mp_rank_00_model_states.pt")), 2,
             [r"lavis_ds: .*step_16/mp_rank_00_model_states\.pt: unreadable .*truncated"], older),
        Case("export a truncated optimizer states file", export_case(
            lambda c: truncate(c / "step_16" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")), 2,
             [r"lavis_ds: .*step_16/zero_pp_rank_0_mp_rank_00_optim_states\.pt: unreadable"], older),
        Case("export a checkpoint with a broken marker", export_case(
            lambda c: (c / "step_16" / "lavis_ds_complete.json").write_text("not json")), 2,
             [r"lavis_ds: .*step_16/lavis_ds_complete\.json: unreadable completion marker"], older),
        # -- runtime
        Case("output_dir is a file", output_dir_case(a_file), 2,
             [r"run\.output_dir: .*taken is a file; give a folder"]),
        Case("output_dir cannot be created", output_dir_case(under_a_file), 2,
             [r"run\.output_dir: cannot write to .*taken/run \(Not a directory"]),
        Case("output_dir not writable", output_dir_case(lambda d: Path("/proc/lavis_ds_mutation/run")), 2,
             [r"run\.output_dir: cannot write to /proc/lavis_ds_mutation/run"]),
        Case("NaN loss, on_nonfinite=stop, 2 processes", nan_case("stop", 2, step=5, rank=1, save_freq_steps=2), 1,
             [r"non-finite loss at optimizer step 5 \(epoch 0\): rank 1, micro-batch 1 of 1: nan \(training samples "
              r"\d+, \d+, \d+, \d+; images train_", r"run\.resume: auto` continues from .*step_4",
              "run.on_nonfinite=skip"], check=nan_stopped),
        Case("NaN loss, on_nonfinite=skip", nan_case("skip", 1, step=5, rank=0, save_freq_steps=1), 0,
             [r"non-finite loss at optimizer step 5"], check=nan_skipped),
        Case("on_nonfinite typo", nan_case("ignore", 1, step=5, rank=0, save_freq_steps=1), 2,
             [r"run\.on_nonfinite.*'stop' \| 'skip'"]),
        Case("lr_scales prefix that names no parameter", fresh("run.lr_scales.llm_prj=10"), 2,
             [r"run\.lr_scales\.llm_prj: matches no parameter of the model; did you mean 'llm_proj'\?"],
             check=trained_nothing),
        # -- the output folder: another run in it, a full disk
        Case("output_dir in use by a training run", busy_folder, 2,
             [r"run\.output_dir: .*out is in use by another run: process \d+ on host \S+, started \d{4}-\d\d-\d\d "
              r"\d\d:\d\d:\d\d [+-]\d{4} \(lock file .*out/lavis_ds\.lock\)", "another run.output_dir"],
             lambda d: list(complete_checkpoints(d / "out")), lambda d, proc: busy.check(d / "out", proc.stderr)),
        Case("lock left by a killed run", killed_runs_lock, 0,
             [r"lavis_ds: run\.output_dir: took over .*lavis_ds\.lock from process \d+ on host \S+, started .*, which "
              r"no longer runs", r"resumed from .*step_4 at epoch 0, step 4"], good("step_4"), took_over),
        Case("lock of a run on another host", foreign_lock, 2,
             [r"run\.output_dir: .*out is locked by process 4242 on host node-b\.cluster, started 2026-11-24 "
              r"21:03:11 \+0000 \(.*lavis_ds\.lock\)\. This host cannot tell whether that run still goes on",
              r"delete .*out/lavis_ds\.lock and start again"], all_four, foreign_lock_kept),
        Case("disk full during a save", full_disk, 1,
             [r"lavis_ds: cannot write the checkpoint .*checkpoints/step_8: torch\.save stopped short writing one of "
              r"its files \('.*unexpected pos \d+ vs \d+'\), as it does when the disk is full or a quota is exceeded",
              r"\d+(\.\d)? (B|KiB|MiB|GiB|TiB) free on the filesystem of .*out/checkpoints now",
              r"The last good checkpoint is .*checkpoints/step_4: `run\.resume: auto` continues from it"],
             good("step_4"), full_disk_resumes),
        Case("disk full under metrics.jsonl, 2 processes", full_disk_metrics, 1,
             [r"lavis_ds: cannot write the metrics file .*out/metrics\.jsonl: No space left on device; the run stopped "
              r"here\. Free space \(or fix the folder\), then run the same command: it continues from the newest "
              r"complete checkpoint"], check=stopped_together),
        Case("disk full during a save, runner_fsdp", full_disk_fsdp, 1,
             [r"lavis_ds: cannot write the checkpoint .*checkpoints/step_8: No space left on device \(",
              r"The last good checkpoint is .*checkpoints/step_4: `run\.resume: auto` continues from it"],
             good("step_4")),
        *([Case("fp16 on a machine that refuses it", fresh("run.precision=fp16"), 2,
                [r"run\.precision: fp16 is not supported on this machine's \w+ device", "run.precision=bf16"],
                check=trained_nothing)] if _fp16_refused() else []),
    ]


@functools.cache
def _fp16_refused() -> bool:
    """Whether DeepSpeed's accelerator here refuses fp16 (this CPU kind: oneDNN has no fp16 kernels for it)."""
    from deepspeed.accelerator import get_accelerator

    return not get_accelerator().is_fp16_supported()


def _grow_or_shrink(d: Path, base: Path, storage: Path, grow: bool) -> TrainLaunch:
    """The base run trained with the ViT frozen (grow) or everything trainable (shrink: freeze the LLM now)."""
    if grow:
        out = d / "out"
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(base.parent / "frozen_vit" / "checkpoints" / "step_16", out / "checkpoints" / "step_16")
        return train_cmd(write_yaml(d / "run.yaml", base_config(out, storage)))
    _, cfg = copy_run(base, d, storage)
    return train_cmd(cfg, 0, "model.freeze_llm=true")


@pytest.fixture(scope="module")
def frozen_vit_run(base_runs) -> Path:
    return base_runs["frozen_vit"]


@pytest.fixture(scope="module")
def outcomes(request, root, demo_storage, base_run, frozen_vit_run) -> dict[str, tuple[Case, Path, subprocess.CompletedProcess]]:
    """Every selected case set up, run (PARALLEL at a time) and recorded, with the checkpoint hashes from before."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    prepared = []
    for i, case in enumerate(cases(demo_storage, base_run)):
        if case.name not in selected:
            continue
        case_dir = root / f"case{i:02d}"
        case_dir.mkdir()
        cmd = case.setup(case_dir)
        case.before = {name: files for name, files in complete_checkpoints(case_dir / "out").items()
                       if name in case.untouched(case_dir)}
        prepared.append((case, case_dir, cmd))

    def run(item):
        case, case_dir, cmd = item
        if isinstance(cmd, TrainLaunch):
            return run_train(cmd.cfg, cmd.nproc, cmd.options, cwd=case_dir, check=False, launcher=cmd.launcher)
        return run_forked("lavis_ds.apps.export:main", list(cmd.argv), case_dir / "export.logs", cwd=case_dir)

    def slow_first(item) -> int:  # a launcher, then several processes: started first, they do not end last
        cmd = item[2]
        return -(2 * (getattr(cmd, "launcher", "fork") == "launch") + (getattr(cmd, "nproc", 0) > 1))

    prepared.sort(key=slow_first)  # stable: the cases' order otherwise
    with ThreadPoolExecutor(PARALLEL) as pool:
        procs = list(pool.map(run, prepared))
    return {case.name: (case, case_dir, proc) for (case, case_dir, _), proc in zip(prepared, procs)}


CASE_NAMES = [c.name for c in cases(Path("/"), Path("/"))]


def test_there_are_enough_cases():
    assert len(CASE_NAMES) >= 20 and len(set(CASE_NAMES)) == len(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_one_clear_answer(outcomes, name):
    case, case_dir, proc = outcomes[name]
    output = proc.stdout + proc.stderr
    context = f"{name}: exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    if "torch.distributed.run" in proc.args and case.exit_code:
        # torchrun exits 1 whenever a worker fails, and reports the first worker's own exit code.
        assert proc.returncode == 1 and re.search(rf"exitcode *: {case.exit_code} ", proc.stderr), context
    else:
        assert proc.returncode == case.exit_code, context
    assert not tracebacks(output), context
    assert STILL_RUNNING not in proc.stderr, context  # each forked process ended by itself, none had to be stopped
    for pattern in case.says:
        assert re.search(pattern, output), f"{pattern!r} not in the output of {context}"
    if case.exit_code:  # the answer is given once, whatever the number of processes
        assert len(re.findall(case.says[0], output)) == 1 and "lavis_ds: " in proc.stderr, context
    after = complete_checkpoints(case_dir / "out")
    for ckpt_name, files in case.before.items():
        assert after.get(ckpt_name) == files, f"{name}: {ckpt_name} changed"
    if case.check:
        case.check(case_dir, proc)
