"""One clear answer for every bad input beyond the config: data, checkpoints, runtime faults.

Every case runs the real train.py / export.py in its own process (forked from the suite's server,
tests/forked.py, or through torchrun) on a copy of one shared run, and checks: the exit code (or the documented graceful outcome), no traceback from
lavis_ds's processes, a message naming the file/key/record/step and what would be valid,
and every checkpoint that was complete before still byte-identical. The cases are data (CASES; their setups and
checks: tests/mutation_setups.py). They start together (a few at a time): most of their wall time is Python
starting up.
(Config/YAML mutations: tests/test_config_mutations.py.)
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import demo_storage_fixture
from forked import STILL_RUNNING
from mutation_setups import (ALL_FOUR, BUSY, OLDER, Case, Material, TrainLaunch, _fp16_refused, a_file,
                             annotations, base_config, busy_folder, complete_checkpoints, data_case, export_case,
                             falls_back, foreign_lock, foreign_lock_kept, fresh, full_disk, full_disk_fsdp,
                             full_disk_metrics, full_disk_resumes, garbage_image, good, grow_or_shrink, kept_damaged,
                             killed_runs_lock, nan_case, nan_skipped, nan_stopped, output_dir_case, record_without,
                             resume_case, resume_names_step_16, resume_tag_step_5, resumed_with, sample_at,
                             stopped_together, took_over, trained_nothing, truncate, under_a_file)
from run_utils import output_of, run_forked, run_train, start, tracebacks, write_yaml

PARALLEL = 4


# ---------------------------------------------------------------- shared material
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutations")


demo_storage = demo_storage_fixture(num_train=64, num_val=8, num_test=8)


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


# ---------------------------------------------------------------- the cases
CASES: tuple[Case, ...] = (
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
         OLDER, falls_back),
    Case("truncated optimizer states (auto)", resume_case(
        lambda c: truncate(c / "step_16" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")),
         0, [r"step_16/zero_pp_rank_0_mp_rank_00_optim_states\.pt: unreadable"], OLDER, falls_back),
    Case("garbage rng file (auto)", resume_case(lambda c: (c / "step_16" / "rng_state_rank0.pt").write_text("x")),
         0, [r"step_16/rng_state_rank0\.pt: unreadable"], OLDER, falls_back),
    Case("missing rng file (auto)", resume_case(lambda c: (c / "step_16" / "rng_state_rank0.pt").unlink()),
         0, [r"step_16/rng_state_rank0\.pt: file missing"], OLDER, falls_back),
    Case("marker is not JSON (auto)", resume_case(lambda c: (c / "step_16" / "lavis_ds_complete.json").write_text("{")),
         0, [r"step_16/lavis_ds_complete\.json: unreadable completion marker"], OLDER, falls_back),
    Case("marker is JSON but not a marker (auto)", resume_case(
        lambda c: (c / "step_16" / "lavis_ds_complete.json").write_text("[]")),
         0, [r"lavis_ds_complete\.json: not a lavis_ds completion marker"], OLDER, falls_back),
    Case("every checkpoint damaged", resume_case(lambda c: [truncate(p) for p in c.glob("step_*/mp_rank_00_*")]),
         2, [r"run\.resume=auto: no readable complete checkpoint", r"run\.resume=false"]),
    # -- checkpoints named explicitly: stop, touch nothing
    Case("run.resume names a truncated checkpoint", resume_names_step_16(
        lambda step: truncate(step / "mp_rank_00_model_states.pt")),
         2, [r"run\.resume=.*step_16: .*mp_rank_00_model_states\.pt: unreadable", "run.resume=auto"],
         OLDER, kept_damaged),
    Case("run.resume names a torn checkpoint", resume_names_step_16(
        lambda step: (step / "lavis_ds_complete.json").unlink()),
         2, [r"step_16 is an incomplete checkpoint .*no lavis_ds_complete\.json",
             r"the newest complete one beside it is .*step_12"], OLDER, kept_damaged),
    Case("run.resume names nothing", resume_case(lambda c: None, resume="/nonexistent/step_3"), 2,
         [r"run\.resume: checkpoint folder '/nonexistent/step_3' does not exist"], ALL_FOUR),
    Case("resume_ckpt_tag names a missing tag", resume_tag_step_5, 2,
         # translated into run.resume (lavis_compat), which the config check finds missing
         [r"run\.resume: checkpoint folder '.*checkpoints/step_5' does not exist"], ALL_FOUR),
    # -- errors during resume: the checkpoint does not fit the model or the engine
    Case("trainable set grew", grow_or_shrink(grow=True), 2,
         [r"parameter\(s\) train now but were not trained in the checkpoint: vision_tower\.vit\.", "freeze_"],
         ALL_FOUR),
    Case("trainable set shrank", grow_or_shrink(grow=False), 2,
         [r"parameter\(s\) trained in the checkpoint are frozen now: .*llm_model\.", "run.resume=false"],
         ALL_FOUR),
    # (Stages 1-3 and fp32/bf16 convert through the universal checkpoint: tests/test_first_hour.py.)
    Case("ZeRO stage changed to one that cannot convert", resumed_with("run.zero_stage=0"), 2,
         [r"step_16 was saved with ZeRO stage 2 in fp32 and this run asks for stage 0 in fp32",
          r"run\.resume=false"], ALL_FOUR),
    Case("precision changed to one that cannot convert", resumed_with("run.precision=fp16"), 2,
         [r"saved with ZeRO stage 2 in fp32 and this run asks for stage 2 in fp16",
          "between fp32 and bf16 only"], ALL_FOUR),
    # -- export
    Case("export a folder that is no checkpoint", export_case(source="plain"), 2,
         [r"lavis_ds: .*plain is not a lavis_ds checkpoint", r"checkpoints/step_<N>"], ALL_FOUR),
    Case("export a truncated model states file", export_case(
        lambda c: truncate(c / "step_16" / "mp_rank_00_model_states.pt")), 2,
         [r"lavis_ds: .*step_16/mp_rank_00_model_states\.pt: unreadable .*truncated"], OLDER),
    Case("export a truncated optimizer states file", export_case(
        lambda c: truncate(c / "step_16" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")), 2,
         [r"lavis_ds: .*step_16/zero_pp_rank_0_mp_rank_00_optim_states\.pt: unreadable"], OLDER),
    Case("export a checkpoint with a broken marker", export_case(
        lambda c: (c / "step_16" / "lavis_ds_complete.json").write_text("not json")), 2,
         [r"lavis_ds: .*step_16/lavis_ds_complete\.json: unreadable completion marker"], OLDER),
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
         lambda d: list(complete_checkpoints(d / "out")), lambda d, proc: BUSY.check(d / "out", proc.stderr)),
    Case("lock left by a killed run", killed_runs_lock, 0,
         [r"lavis_ds: run\.output_dir: took over .*lavis_ds\.lock from process \d+ on host \S+, started .*, which "
          r"no longer runs", r"resumed from .*step_4 at epoch 0, step 4"], good("step_4"), took_over),
    Case("lock of a run on another host", foreign_lock, 2,
         [r"run\.output_dir: .*out is locked by process 4242 on host node-b\.cluster, started 2026-11-24 "
          r"21:03:11 \+0000 \(.*lavis_ds\.lock\)\. This host cannot tell whether that run still goes on",
          r"delete .*out/lavis_ds\.lock and start again"], ALL_FOUR, foreign_lock_kept),
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
)


@pytest.fixture(scope="module")
def frozen_vit_run(base_runs) -> Path:
    return base_runs["frozen_vit"]


@pytest.fixture(scope="module")
def outcomes(request, root, demo_storage, base_run, frozen_vit_run) -> dict[str, tuple]:
    """Every selected case set up, run (PARALLEL at a time) and recorded: (case, its folder, the process, the hashes
    of the checkpoints it must leave untouched, from before)."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    material, prepared = Material(demo_storage, base_run), []
    for i, case in enumerate(CASES):
        if case.name not in selected:
            continue
        case_dir = root / f"case{i:02d}"
        case_dir.mkdir()
        cmd = case.setup(case_dir, material)
        before = {name: files for name, files in complete_checkpoints(case_dir / "out").items()
                  if name in case.untouched(case_dir)}
        prepared.append((case, case_dir, cmd, before))

    def run(item):
        case, case_dir, cmd, _ = item
        if isinstance(cmd, TrainLaunch):
            return run_train(cmd.cfg, cmd.nproc, cmd.options, cwd=case_dir, check=False, launcher=cmd.launcher)
        return run_forked("lavis_ds.apps.export:main", list(cmd.argv), case_dir / "export.logs", cwd=case_dir)

    def slow_first(item) -> int:  # a launcher, then several processes: started first, they do not end last
        cmd = item[2]
        return -(2 * (getattr(cmd, "launcher", "fork") == "launch") + (getattr(cmd, "nproc", 0) > 1))

    prepared.sort(key=slow_first)  # stable: the cases' order otherwise
    with ThreadPoolExecutor(PARALLEL) as pool:
        procs = list(pool.map(run, prepared))
    return {case.name: (case, case_dir, proc, before) for (case, case_dir, _, before), proc in zip(prepared, procs)}


CASE_NAMES = [c.name for c in CASES]


def test_there_are_enough_cases():
    assert len(CASE_NAMES) >= 20 and len(set(CASE_NAMES)) == len(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_one_clear_answer(outcomes, name):
    case, case_dir, proc, before = outcomes[name]
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
    for ckpt_name, files in before.items():
        assert after.get(ckpt_name) == files, f"{name}: {ckpt_name} changed"
    if case.check:
        case.check(case_dir, proc)
