"""LLaVA-size data: start-up time and DataLoader-worker memory, packed records against lists of records.

    python benchmarks/data_scale.py [--records 665298] [--workers 4] [--old-rev 81997d3]

Data: ``benchmarks/llava_mix.py`` writes a synthetic llava_v1_5_mix665k (the real mix's record
shapes, ~40k text-only records, six image folders of hard links to tiny JPEGs) once into
``--data`` (default ``$LAVIS_DS_CACHE/data_scale``, else ``~/.cache/lavis_ds/data_scale``).

Two code trees read it, side by side in one run:
  new  this checkout: records packed per file (``lavis_ds/datasets/record_store.py``), each
       annotation file parsed once per process (the config check hands it to the build).
  old  ``--old-rev`` extracted with ``git archive``: lists of ``InstructionRecord`` objects, the
       file parsed by the config check and again by the build (the code before the change).

Measured for each tree:
1. Start-up: a real ``python train.py`` of the tiny BLIP2-Qwen (ZeRO-2, fp32, one process,
   ``run.num_workers`` = ``--workers``) on the mix with ``skip_text_only: true``: seconds from
   launching the process to the first optimizer step's line in metrics.jsonl (Python start-up,
   config check, model build, dataset build, DeepSpeed set-up, the first step), the main
   process's peak RSS (``wait4``) and its RSS/USS/PSS at that step. The run is then killed.
2. Where the time goes and worker memory, in a fresh process: ``load_config`` (the config check)
   and ``build_datasets`` timed, then an epoch's worth of index lookups through the real
   dataset in a DataLoader with ``--workers`` forked workers (shuffled, ``--batch`` indices per
   batch; a lookup reads ``dataset.records[i]`` and the length of every text of the record, as
   ``__getitem__`` does before it processes them; images are not decoded). RSS/USS/PSS (psutil)
   of the main process and of every worker after the first batch and after the epoch.
Nothing is asserted; figures go to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("LAVIS_DS_CACHE", Path.home() / ".cache" / "lavis_ds"))
    parser.add_argument("--records", type=int, default=665_298, help="records in the synthetic mix")
    parser.add_argument("--data", type=Path, default=cache / "data_scale", help="where the mix is written (reused)")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader workers (run.num_workers)")
    parser.add_argument("--batch", type=int, default=256, help="indices per DataLoader batch in the lookups")
    parser.add_argument("--old-rev", default="81997d3", help="git revision of the list-of-records code")
    parser.add_argument("--trees", default="new,old", help="which trees to measure, in this order")
    parser.add_argument("--lookups", type=Path, help=argparse.SUPPRESS)  # internal: measure in this process
    args = parser.parse_args(argv)
    if args.workers < 1:  # the figures are the workers' memory: with none there is nothing to measure
        parser.error(f"--workers {args.workers}: at least 1 (the DataLoader workers' memory is what is measured)")
    return args


# ---------------------------------------------------------------------------------------- measuring

def memory(pid: int) -> dict[str, float]:
    """RSS, USS and PSS of one process in MiB (USS/PSS from /proc/<pid>/smaps, via psutil)."""
    import psutil

    info = psutil.Process(pid).memory_full_info()
    return {"rss": info.rss / MiB, "uss": info.uss / MiB, "pss": info.pss / MiB}


def workers_memory() -> list[dict[str, float]]:
    import psutil

    return [memory(child.pid) for child in psutil.Process().children()]


def lookups(cfg_path: Path, workers: int, batch: int) -> dict:
    """In this process (run with PYTHONPATH set to one tree): time the check and the build, then read an epoch."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    import lavis_ds  # noqa: F401  (fills the registries)
    from lavis_ds.build import build_datasets
    from lavis_ds.config import load_config

    try:  # the new tree hands what the check parsed to the build; the old one has no such thing
        from lavis_ds.datasets.loading import ParsedFiles
        parsed = {"parsed_files": ParsedFiles()}
    except ImportError:
        parsed = {}
    start, start_cpu = time.perf_counter(), time.process_time()
    cfg = load_config(cfg_path, world_size=1, **parsed)
    checked, checked_cpu = time.perf_counter(), time.process_time()
    dataset = build_datasets(cfg.datasets, *parsed.values())["llava"]["train"]
    built, built_cpu = time.perf_counter(), time.process_time()
    parsed.clear()  # as train.py: only the datasets keep what was parsed

    class RecordLookups(Dataset):
        """Index -> the record's text lengths, read from the real dataset's records (no image decoding)."""

        def __len__(self):
            return len(dataset)

        def __getitem__(self, index):
            record = dataset.records[index]
            return len(record.image) + sum(len(t) for t in record.instructions) + sum(len(t) for t in record.outputs)

    result = {"lavis_ds": lavis_ds.__file__, "records": len(dataset), "check_s": checked - start,
              "build_s": built - checked, "check_cpu_s": checked_cpu - start_cpu, "build_cpu_s": built_cpu - checked_cpu,
              "main_after_build": memory(os.getpid())}
    loader = DataLoader(RecordLookups(), batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=True,
                        collate_fn=sum, generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    total = next(batches)
    result["workers_first_batch"] = workers_memory()
    lookup_start = time.perf_counter()
    for value in batches:
        total += value
    result["epoch_s"] = time.perf_counter() - lookup_start
    result["workers_after_epoch"] = workers_memory()
    result["main_after_epoch"] = memory(os.getpid())
    result["checksum"] = total
    return result


def startup(tree: Path, cfg_path: Path, out: Path) -> dict:
    """Launch train.py of ``tree``; seconds to the first optimizer step, and the main process's memory."""
    import psutil

    metrics = out / "metrics.jsonl"
    launched = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(tree / "train.py"), "--cfg-path", str(cfg_path)], cwd=tree,
                            env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    first_step = None
    while proc.poll() is None:
        if metrics.is_file() and '"step"' in metrics.read_text():
            first_step = time.perf_counter() - launched
            break
        time.sleep(0.05)
    if first_step is None:
        raise RuntimeError(f"{tree / 'train.py'} ended before its first step (exit {proc.returncode}):\n"
                           f"{proc.stderr.read().decode()[-3000:]}")
    at_step = memory(proc.pid)
    workers = [memory(c.pid) for c in psutil.Process(proc.pid).children()]
    os.killpg(proc.pid, signal.SIGKILL)
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = -9
    proc.stderr.close()
    return {"first_step_s": first_step, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss": usage.ru_maxrss / 1024,
            "at_first_step": at_step, "workers_at_first_step": workers, "load": os.getloadavg()[0]}


def _env(tree: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


# ---------------------------------------------------------------------------------------- set-up

def old_tree(rev: str, dest: Path) -> Path:
    """The code of ``rev`` (lavis_ds and train.py) extracted from this checkout's git history."""
    archive = dest / "old.tar"
    with archive.open("wb") as f:
        done = subprocess.run(["git", "-C", str(REPO), "archive", rev, "lavis_ds", "train.py"], stdout=f,
                              stderr=subprocess.PIPE, text=False)
    if done.returncode:
        raise SystemExit(f"--old-rev {rev}: git archive failed (is {REPO} a git checkout holding that commit?): "
                         f"{done.stderr.decode().strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "old", filter="data")
    return dest / "old"


def write_config(path: Path, out: Path, annotation: Path, images: Path, tokenizer: Path, workers: int,
                 stage_in_deepspeed_section: bool = False) -> Path:
    """The run YAML; ``stage_in_deepspeed_section``: the ZeRO stage spelled in ``run.deepspeed_config`` (the only
    spelling the old tree knows) rather than as ``run.zero_stage``; DeepSpeed gets the same stage either way."""
    from harness.configs import tiny_config, write_yaml

    cfg = tiny_config(out, tokenizer.parent, stage=None if stage_in_deepspeed_section else 2, micro=4,
                      num_workers=workers)
    if stage_in_deepspeed_section:
        cfg["run"]["deepspeed_config"] = {"zero_optimization": {"stage": 2}}
    cfg["datasets"] = {"llava": {
        "builder": "llava_conversation", "skip_text_only": True,
        "build_info": {"annotations": {"train": {"storage": str(annotation)}}, "images": {"storage": str(images)}},
        "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 64},
                          "eval": {"name": "blip2_image_eval", "image_size": 64}}}}
    return write_yaml(path, cfg)


# ---------------------------------------------------------------------------------------- report

def _mem(m: dict) -> str:
    return f"RSS {m['rss']:.0f} / USS {m['uss']:.0f} / PSS {m['pss']:.0f}"


def _growth(first: list[dict], last: list[dict], key: str) -> list[float]:
    return [b[key] - a[key] for a, b in zip(first, last)]


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\n{args.records} records, {args.workers} DataLoader workers, {os.cpu_count()} cores; memory in MiB")
    for name, r in results.items():
        s, m = r["startup"], r["lookups"]
        uss = _growth(m["workers_first_batch"], m["workers_after_epoch"], "uss")
        rss = _growth(m["workers_first_batch"], m["workers_after_epoch"], "rss")
        print(f"\n[{name}] {m['lavis_ds']}")
        print(f"  train.py launch -> first optimizer step: {s['first_step_s']:.1f} s ({s['cpu_s']:.1f} CPU s in the "
              f"main process; load average {s['load']:.1f}); main process peak RSS {s['peak_rss']:.0f}, at the first "
              f"step {_mem(s['at_first_step'])}")
        print(f"  config check {m['check_s']:.1f} s ({m['check_cpu_s']:.1f} CPU s) + dataset build {m['build_s']:.1f} s "
              f"({m['build_cpu_s']:.1f} CPU s), {m['records']} records; main process after the build: "
              f"{_mem(m['main_after_build'])}")
        print(f"  epoch of lookups ({m['epoch_s']:.1f} s): per worker after the first batch / after the epoch:")
        for k, (a, b) in enumerate(zip(m["workers_first_batch"], m["workers_after_epoch"])):
            print(f"    worker {k}: {_mem(a)}  ->  {_mem(b)}")
        print(f"  worker growth over the epoch: USS +{max(uss):.0f} max (mean +{sum(uss) / len(uss):.0f}), "
              f"RSS +{max(rss):.0f} max; main process after the epoch: {_mem(m['main_after_epoch'])}")
    if {"new", "old"} <= results.keys():
        new, old = results["new"], results["old"]
        grow = {k: max(_growth(v["lookups"]["workers_first_batch"], v["lookups"]["workers_after_epoch"], "uss"))
                for k, v in results.items()}
        print(f"\nold/new: start-up {old['startup']['first_step_s'] / new['startup']['first_step_s']:.2f}x "
              f"(CPU {old['startup']['cpu_s'] / new['startup']['cpu_s']:.2f}x), "
              f"check+build {(old['lookups']['check_s'] + old['lookups']['build_s']) / (new['lookups']['check_s'] + new['lookups']['build_s']):.2f}x, "
              f"main-process USS after build "
              f"{old['lookups']['main_after_build']['uss'] / new['lookups']['main_after_build']['uss']:.2f}x, "
              f"worker USS growth +{grow['old']:.0f} vs +{grow['new']:.0f} MiB")
    print(f"aims (new): start-up under 60 s: {results.get('new', {}).get('startup', {}).get('first_step_s', float('nan')):.1f} s; "
          f"worker growth under 50 MB over the epoch")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.lookups is not None:
        print("RESULT " + json.dumps(lookups(args.lookups, args.workers, args.batch)), flush=True)
        return
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from llava_mix import describe, write_llava_mix

    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

    started = time.perf_counter()
    annotation, images = write_llava_mix(args.data, args.records)
    print(f"data ready in {time.perf_counter() - started:.0f} s: {describe(annotation)}", flush=True)
    tokenizer = ensure_demo_shapes(args.data / "demo_shapes", DemoShapesSpec(num_train=16, num_val=4, num_test=4)) / "tokenizer"
    results = {}
    with tempfile.TemporaryDirectory(prefix="data_scale_") as tmp:
        tmp = Path(tmp)
        trees = {"new": REPO, "old": old_tree(args.old_rev, tmp) if "old" in args.trees else None}
        for name in args.trees.split(","):
            tree = trees[name]
            out = tmp / f"out_{name}"
            cfg = write_config(tmp / f"{name}.yaml", out, annotation, images, tokenizer, args.workers,
                               stage_in_deepspeed_section=name == "old")
            print(f"[{name}] train.py start-up ...", flush=True)
            result = {"startup": startup(tree, cfg, out)}
            print(f"[{name}] check, build, an epoch of lookups ...", flush=True)
            done = subprocess.run([sys.executable, __file__, "--lookups", str(cfg), "--workers", str(args.workers),
                                   "--batch", str(args.batch)], env=_env(tree), cwd=tree, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                raise RuntimeError(f"[{name}] lookups failed ({done.returncode}):\n{done.stderr[-4000:]}")
            result["lookups"] = json.loads(lines[-1][len("RESULT "):])
            results[name] = result
    report(results, args)


if __name__ == "__main__":
    main()
