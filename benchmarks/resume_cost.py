"""Resume cost: wall time from process start to the first resumed optimizer step, resuming at
the start of an epoch versus near its end, on an epoch of 100,000 samples.

    python benchmarks/resume_cost.py [--nproc 1] [--repeats 5] [--workdir DIR]

Set-up (in `--workdir`, or a temporary folder removed at the end):

1. Data: the demo_shapes generator (`ensure_demo_shapes`) writes a pool of real PNG images and
   the ChatML tokenizer trained on its texts; `--num-records` (100,000) MiniGPT4Qwen instruction
   records are written to one JSON file, record i being the demo's train record i mod pool size
   (so 100,000 records share `--pool` 2,000 image files: the disk stays small). The training
   run reads them with the real `minigpt4qwen_instruction` builder.
2. Config: `tests/run_utils.tiny_config` (tiny BLIP2-Qwen, ZeRO-2, fp32, log every step) with that
   dataset, micro-batch 8, accumulation 1, 2 epochs, no validation or test splits.
3. One real checkpoint: `train.py` trains the first `--source-steps` steps of that run, saves
   (`run.save_freq_steps`) and is killed once the checkpoint is marked complete.
4. Two positions of that checkpoint, copied: "early" = epoch 1, 0 steps into it (what the run
   saves at the end of epoch 0) and "late" = epoch 1, steps_per_epoch - 2 steps into it. Training
   through 100,000 samples to reach the late one would take hours on a 2-core CPU, so the
   benchmark writes the position instead: the `lavis_ds` client state in
   `mp_rank_00_model_states.pt` (`train_state`, the scheduler's `last_step`), DeepSpeed's own
   `global_steps` / `global_samples` there, the folder name `step_<N>` and the completeness marker.
   The weights and optimizer moments are those of step `--source-steps`; what is measured is the
   cost of the *position*, which they do not affect (same tensors, same file sizes).
   Each resumed run gets a fresh output folder holding the `metrics.jsonl` the original run would
   have written up to that position (one line per step, `log_freq` 1, copied from the source
   run's first line with the step renumbered): the logger reads it on resume, a cost that grows
   with the global step. `--no-metrics-history` starts from an empty folder instead.

Measurement: early and late are launched alternately, the order within each repetition
swapped every other repetition (early late, late early, early late, ...) so that whatever comes
of following the other launch hits both alike; `--repeats` launches each, with the same command
(`train.py ... run.resume=<checkpoint folder> run.log_freq=1`). For each launch: the wall time
(`time.monotonic`, in this process) from just before the process is started to (a) its
"resumed from ..." line on stdout (checkpoint loaded) and (b) the first new line in
`metrics.jsonl` (written by the logging hook right after the first resumed optimizer step); then
the launcher and every process under it are killed. Reported: medians, the ratio of medians
late/early and the median over repetitions of late_i/early_i, for start -> first step and for
the window (a) -> (b), where everything that depends on the position happens (sampler,
DataLoader iterator, logger).

Control, in the same run (one block after each early/late pair, in this process, while no
training process runs): what a replaying design would pay - the seconds per sample of pulling
micro-batches through the same DataLoader (the run's dataset, `StepBatchSampler`, collater and
`num_workers`), times the samples the late checkpoint has consumed in its epoch on one rank.
`--control-full` also loads every one of those samples once, for real.
Timings are printed, never asserted: shared machines are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "tests"))

from run_utils import command, env, tiny_config, write_yaml  # noqa: E402

POSITIONS = ("early", "late")  # the order within each repetition
DATASET = "minigpt4qwen_instruction"
MICRO_BATCH = 8
MAX_EPOCH = 2  # both positions are in epoch 1; its start is the end-of-epoch-0 checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="training processes (1: python train.py, "
                                                             ">1: torchrun)")
    parser.add_argument("--repeats", type=int, default=5, help="launches per position")
    parser.add_argument("--num-records", type=int, default=100_000, help="records in the training epoch")
    parser.add_argument("--pool", type=int, default=2000, help="distinct PNG images the records point at")
    parser.add_argument("--num-workers", type=int, default=0, help="run.num_workers (DataLoader workers)")
    parser.add_argument("--source-steps", type=int, default=2, help="steps the real checkpoint is trained")
    parser.add_argument("--control-batches", type=int, default=100,
                        help="micro-batches per control block (the replay cost per sample)")
    parser.add_argument("--control-full", action="store_true",
                        help="also load every sample the late checkpoint consumed once (slow)")
    parser.add_argument("--workdir", default=None,
                        help="keep data and checkpoints here (reused if present); default: a temporary folder")
    parser.add_argument("--no-metrics-history", action="store_true",
                        help="resume into an empty output folder (no metrics.jsonl to read back)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a launch counts as hung")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ set-up
def make_data(workdir: Path, num_records: int, pool: int) -> tuple[Path, Path]:
    """(annotation file, demo storage with images/ and tokenizer/)."""
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

    storage = ensure_demo_shapes(workdir / "demo_shapes", DemoShapesSpec(num_train=pool, num_val=1, num_test=1))
    annotations = workdir / f"train_{num_records}.json"
    if not annotations.is_file():
        pool_records = json.loads((storage / "annotations" / "train.json").read_text())
        records = [pool_records[i % len(pool_records)] for i in range(num_records)]
        tmp = annotations.with_suffix(".tmp")
        tmp.write_text(json.dumps(records, indent=1) + "\n")
        os.replace(tmp, annotations)
    return annotations, storage


def make_config(workdir: Path, annotations: Path, storage: Path, num_workers: int) -> Path:
    cfg = tiny_config(workdir / "unused_output", storage, stage=2, dtype="fp32", micro=MICRO_BATCH,
                      max_epoch=MAX_EPOCH, save_freq_steps=0, resume=False, valid_splits=[], test_splits=[],
                      num_workers=num_workers)
    cfg["datasets"] = {DATASET: {
        "build_info": {"annotations": {"train": {"storage": str(annotations)}},
                       "images": {"storage": str(storage / "images")}},
        # the demo's processors: the tiny model takes 64-px images
        "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 64, "min_scale": 0.8},
                          "eval": {"name": "blip2_image_eval", "image_size": 64}},
        "text_processor": {"train": {"name": "plain_text"}, "eval": {"name": "plain_text"}},
    }}
    return write_yaml(workdir / "resume_cost.yaml", cfg)


def steps_per_epoch(num_records: int, nproc: int) -> int:
    from lavis_ds.datasets.samplers import StepBatchSampler

    return StepBatchSampler(num_records, MICRO_BATCH, 1, nproc, 0, seed=0).steps_per_epoch


def make_source_checkpoint(cfg_path: Path, workdir: Path, nproc: int, steps: int, timeout: float) -> Path:
    """Train the run's first `steps` steps for real, save, kill; return the complete checkpoint folder."""
    from lavis_ds.runners import checkpoint as ckpt

    out = workdir / f"source_nproc{nproc}"
    tag_dir = out / "checkpoints" / ckpt.tag_for(steps)
    if ckpt.is_complete(tag_dir):
        return tag_dir
    shutil.rmtree(out, ignore_errors=True)
    options = (f"run.output_dir={out}", f"run.save_freq_steps={steps}", "run.resume=false")
    out.mkdir(parents=True)
    with (out / "train.log").open("w") as log:
        proc = _start(cfg_path, nproc, options, stdout=log, stderr=log)
        try:
            _wait_for(lambda: ckpt.is_complete(tag_dir), proc, timeout, out / "train.log")
        finally:
            _kill(proc)
    return tag_dir


def place_checkpoint(source: Path, dest_root: Path, epoch: int, global_step: int, step_in_epoch: int,
                     global_batch: int) -> Path:
    """A copy of `source` whose saved position is (epoch, global_step, step_in_epoch)."""
    import torch

    from lavis_ds.runners import checkpoint as ckpt
    from lavis_ds.runners.deepspeed.checkpoint import model_states_file

    tag_dir = dest_root / ckpt.tag_for(global_step)
    if ckpt.is_complete(tag_dir):
        return tag_dir
    shutil.rmtree(dest_root, ignore_errors=True)
    shutil.copytree(source, tag_dir)
    marker = ckpt.read_marker(tag_dir)  # keeps world_size and global_batch, which resume reads
    (tag_dir / ckpt.COMPLETE_MARKER).unlink()
    states_path = model_states_file(tag_dir)
    states = torch.load(states_path, weights_only=False)
    client = states["lavis_ds"]
    client["train_state"] = {"epoch": epoch, "global_step": global_step, "step_in_epoch": step_in_epoch}
    client["scheduler"]["last_step"] = global_step
    states["global_steps"], states["global_samples"] = global_step, global_step * global_batch
    torch.save(states, states_path)
    ckpt.mark_complete(tag_dir, {**marker, "global_step": global_step, "epoch": epoch,
                                 "note": f"position written by benchmarks/resume_cost.py; weights and optimizer "
                                         f"state are those of {source}"})
    return tag_dir


def metrics_history(source_run: Path, dest: Path, global_step: int, steps_in_epoch: int) -> Path:
    """The metrics.jsonl a run logging every step has written by `global_step`."""
    template = json.loads((source_run / "metrics.jsonl").read_text().splitlines()[0])
    with dest.open("w") as f:
        for step in range(1, global_step + 1):
            f.write(json.dumps({**template, "step": step, "epoch": (step - 1) // steps_in_epoch}) + "\n")
    return dest


# --------------------------------------------------------------------------------- processes
def _start(cfg_path: Path, nproc: int, options, **kwargs) -> subprocess.Popen:
    # nproc 1 is plain `python train.py` (run_utils.command's nproc=0).
    return subprocess.Popen(command(cfg_path, nproc if nproc > 1 else 0, tuple(options)), cwd=REPO, env=env(),
                            **kwargs)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launched process and every process under it, by pid.

    Not by process group: torchrun starts each worker in a session of its own, so killing
    torchrun's group leaves the workers training.
    """
    import psutil  # a DeepSpeed dependency

    try:
        launcher = psutil.Process(proc.pid)
        family = [launcher, *launcher.children(recursive=True)]  # listed before anyone is reparented
    except psutil.NoSuchProcess:
        family = []
    for p in family:  # the launcher first, so it cannot react to its workers' deaths
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family[1:], timeout=10)


def _wait_for(done, proc: subprocess.Popen, timeout: float, log: Path, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise RuntimeError(f"train.py exited with {proc.returncode} before the event; log {log}:\n"
                               + log.read_text()[-4000:])
        if time.monotonic() > deadline:
            raise TimeoutError(f"no event within {timeout} s; log {log}")
        time.sleep(poll)


def _last_step(path: Path, initial_size: int) -> int | None:
    """The step of the last complete line of metrics.jsonl once it has grown past `initial_size`."""
    try:
        size = path.stat().st_size
        if size <= initial_size:
            return None
        with path.open("rb") as f:
            f.seek(max(0, size - 4096))
            lines = f.read().split(b"\n")
        return json.loads(lines[-2])["step"] if len(lines) >= 2 else None
    except (OSError, ValueError, KeyError):  # mid-rewrite or mid-line: look again
        return None


def time_resume(cfg_path: Path, nproc: int, tag_dir: Path, history: Path | None, out: Path,
                global_step: int, timeout: float) -> dict:
    """Seconds from process start to 'resumed from' on stdout and to the first new metrics line."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    if history is not None:
        shutil.copyfile(history, metrics)
    initial_size = metrics.stat().st_size if history is not None else 0
    options = (f"run.output_dir={out}", f"run.resume={tag_dir}", "run.log_freq=1")
    stderr = (out / "stderr.log").open("w")
    resumed_at: list[float] = []
    t0 = time.monotonic()
    proc = _start(cfg_path, nproc, options, stdout=subprocess.PIPE, stderr=stderr, text=True)

    def read_stdout():
        with (out / "stdout.log").open("w") as log:
            for line in proc.stdout:
                if line.startswith("resumed from") and not resumed_at:
                    resumed_at.append(time.monotonic())
                log.write(line)

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        _wait_for(lambda: _last_step(metrics, initial_size) is not None, proc, timeout, out / "stderr.log")
        t_step = time.monotonic()
    finally:
        _kill(proc)
        stderr.close()
    reader.join(timeout=5)
    step = _last_step(metrics, initial_size)
    if step != global_step + 1:
        raise RuntimeError(f"first new metrics line is step {step}, expected {global_step + 1} ({metrics})")
    return {"resumed": resumed_at[0] - t0 if resumed_at else float("nan"), "first_step": t_step - t0}


# ----------------------------------------------------------------------------------- control
class ReplayControl:
    """The DataLoader a replaying resume would iterate through the consumed samples (rank 0's share)."""

    def __init__(self, cfg_path: Path, nproc: int):
        from omegaconf import OmegaConf
        from torch.utils.data import DataLoader

        import lavis_ds  # noqa: F401  (fills the registries)
        from lavis_ds.build import build_datasets
        from lavis_ds.config import load_config
        from lavis_ds.common.seeding import SeededDataset
        from lavis_ds.datasets.samplers import StepBatchSampler

        cfg = load_config(cfg_path, world_size=nproc)
        run = OmegaConf.to_container(cfg.run)
        records = build_datasets(cfg.datasets)[DATASET]["train"]
        # as TrainData builds its training set, sampler and DataLoader
        self.dataset = SeededDataset(records, run["seed"])
        self.sampler = StepBatchSampler(len(self.dataset), MICRO_BATCH, 1, nproc, 0, seed=run["seed"])
        self.loader = DataLoader(self.dataset, batch_sampler=self.sampler, collate_fn=records.collater,
                                 num_workers=run["num_workers"], persistent_workers=False)

    def seconds_per_sample(self, epoch: int, start_step: int, batches: int) -> float:
        self.sampler.set_position(epoch, start_step)
        self.dataset.set_epoch(epoch)
        start = time.monotonic()
        samples = 0
        for i, batch in enumerate(self.loader):
            samples += len(batch["index"])
            if i + 1 == batches:
                break
        return (time.monotonic() - start) / samples

    def load_all(self, epoch: int, steps: int) -> tuple[float, int]:
        """Seconds to load this rank's micro-batches of the first `steps` steps of `epoch`, and how many samples."""
        self.sampler.set_position(epoch, 0)
        self.dataset.set_epoch(epoch)
        start, samples = time.monotonic(), 0
        for i, batch in enumerate(self.loader):
            if i == steps:  # accumulation 1: one micro-batch per step
                break
            samples += len(batch["index"])
        return time.monotonic() - start, samples


# -------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")  # as the launched runs get
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lavis_ds_resume_cost_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: Path) -> int:
    t = time.monotonic()
    annotations, storage = make_data(workdir, args.num_records, args.pool)
    cfg_path = make_config(workdir, annotations, storage, args.num_workers)
    spe = steps_per_epoch(args.num_records, args.nproc)
    global_batch = MICRO_BATCH * args.nproc
    print(f"data: {args.num_records} records over {args.pool} PNG images; {spe} steps per epoch of global "
          f"batch {global_batch} ({time.monotonic() - t:.0f} s)", flush=True)

    t = time.monotonic()
    source = make_source_checkpoint(cfg_path, workdir, args.nproc, args.source_steps, args.timeout)
    print(f"real checkpoint after {args.source_steps} trained steps: {source} ({time.monotonic() - t:.0f} s)",
          flush=True)
    positions = {"early": (1, spe, 0), "late": (1, 2 * spe - 2, spe - 2)}  # (epoch, global step, step in epoch)
    tag_dirs, histories = {}, {}
    for name, (epoch, global_step, in_epoch) in positions.items():
        root = workdir / f"checkpoints_{name}_nproc{args.nproc}"
        tag_dirs[name] = place_checkpoint(source, root, epoch, global_step, in_epoch, global_batch)
        histories[name] = None if args.no_metrics_history else metrics_history(
            source.parent.parent, workdir / f"metrics_{name}.jsonl", global_step, spe)
        print(f"{name}: {tag_dirs[name]} (epoch {epoch}, {in_epoch} steps into it)", flush=True)

    control = ReplayControl(cfg_path, args.nproc)
    times: dict[str, list[dict]] = {name: [] for name in POSITIONS}
    per_sample: list[float] = []
    print(f"\n{'rep':>3} {'position':<8}{'to resumed s':>14}{'to first step s':>17}", flush=True)
    for rep in range(args.repeats):
        for name in (POSITIONS if rep % 2 == 0 else POSITIONS[::-1]):
            _, global_step, _ = positions[name]
            r = time_resume(cfg_path, args.nproc, tag_dirs[name], histories[name], workdir / "resumed_run",
                            global_step, args.timeout)
            times[name].append(r)
            print(f"{rep:>3} {name:<8}{r['resumed']:>14.2f}{r['first_step']:>17.2f}", flush=True)
        # a different stretch of the epoch each time, so the control is not one lucky window
        start = rep * args.control_batches % max(1, spe - args.control_batches)
        per_sample.append(control.seconds_per_sample(1, start, args.control_batches))
        print(f"{rep:>3} control  {per_sample[-1] * 1e3:.3f} ms per sample ({args.control_batches} micro-batches "
              f"of {MICRO_BATCH})", flush=True)

    full = control.load_all(1, spe - 2) if args.control_full else None
    report(args, spe, positions, times, per_sample, full)
    return 0


def report(args, spe: int, positions: dict, times: dict, per_sample: list[float], full) -> None:
    for name in POSITIONS:
        for r in times[name]:
            r["window"] = r["first_step"] - r["resumed"]
    keys = ("resumed", "first_step", "window")
    med = {name: {k: statistics.median(r[k] for r in times[name]) for k in keys} for name in POSITIONS}
    paired = {k: statistics.median(late[k] / early[k] for early, late in zip(times["early"], times["late"]))
              for k in ("first_step", "window")}
    consumed = positions["late"][2] * MICRO_BATCH  # this rank's samples of the late position's epoch so far
    sample_s = statistics.median(per_sample)
    print(f"\nresume cost: {args.nproc} process(es), {args.num_records} samples per epoch, micro-batch "
          f"{MICRO_BATCH}, {spe} steps per epoch, num_workers {args.num_workers}, "
          f"{'no metrics history' if args.no_metrics_history else 'metrics.jsonl of every step so far'}; "
          f"{args.repeats} launches per position, alternating")
    print(f"{'position':<9}{'step in epoch':>14}{'median to resumed s':>21}{'median to first step s':>24}"
          f"{'median resumed -> first step s':>32}")
    for name in POSITIONS:
        m = med[name]
        print(f"{name:<9}{positions[name][2]:>14}{m['resumed']:>21.2f}{m['first_step']:>24.2f}{m['window']:>32.3f}")
    for k, what in (("first_step", "start -> first step"), ("window", "resumed -> first step")):
        print(f"ratio late/early, {what}: {med['late'][k] / med['early'][k]:.3f} (medians), "
              f"{paired[k]:.3f} (median over repetitions of late_i/early_i)")
    print(f"control: loading a sample through the DataLoader costs {sample_s * 1e3:.3f} ms (median of "
          f"{len(per_sample)} blocks of {args.control_batches} micro-batches); replaying the {consumed} samples "
          f"consumed per rank at the late position would cost {sample_s * consumed:.1f} s", flush=True)
    if full is not None:
        seconds, samples = full
        print(f"control, for real: loading those {samples} samples took {seconds:.1f} s "
              f"({seconds / samples * 1e3:.3f} ms per sample)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
