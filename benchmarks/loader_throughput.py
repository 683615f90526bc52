"""Samples/s of the training DataLoader with 0, 2 and 4 workers, against the step time it must feed.

    python benchmarks/loader_throughput.py [--workers 0,2,4] [--batches 24] [--micro 16]

Data: ``--images`` JPEGs of COCO's size (640x480, ~100 KB, smooth colour fields plus noise so
that they compress like photographs) and a LLaVA conversation file of ``--records`` records
using them (``benchmarks/llava_mix.py``'s record shapes), written once under ``--data``.

The loader is the trainer's own: the tiny BLIP2-Qwen demo run (``harness.configs.tiny_config``:
one process, ZeRO-2, fp32, micro-batch ``--micro``, 64-pixel images) is built as ``train.py``
builds it, and for each worker count its ``_loader`` makes the training DataLoader over a
dataset of this data (``SeededDataset`` + ``InstructionDataset``: JPEG decode, the
``blip2_image_train`` processor, collate) and a ``StepBatchSampler``, as the trainer does for
its own training set. Two datasets from the ``llava_conversation`` builder: 64-pixel
processors (the tiny model's) and 224-pixel ones (the full-size recipes'). Per setting the
first batch (worker start-up) is timed apart, then ``--batches`` batches give samples/s.

The step it must feed: that trainer's ``run_step`` on micro-batches of its demo data read
beforehand (median of ``--steps`` steps after 3 warm-up steps); the loader keeps up when its
samples/s exceed micro-batch x accumulation / step time. Nothing is asserted; figures go to
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("LAVIS_DS_CACHE", Path.home() / ".cache" / "lavis_ds"))
    parser.add_argument("--data", type=Path, default=cache / "loader_throughput", help="where the data is written")
    parser.add_argument("--images", type=int, default=64, help="distinct 640x480 JPEGs")
    parser.add_argument("--records", type=int, default=2048, help="records of the annotation file")
    parser.add_argument("--workers", default="0,2,4", help="DataLoader worker counts to measure")
    parser.add_argument("--micro", type=int, default=16, help="micro-batch (the demo's)")
    parser.add_argument("--batches", type=int, default=24, help="timed batches per setting (after the first)")
    parser.add_argument("--steps", type=int, default=15, help="timed optimizer steps of the tiny model")
    return parser.parse_args(argv)


def write_data(folder: Path, images: int, records: int) -> tuple[Path, Path]:
    """``(annotation file, image root)``: COCO-size JPEGs and LLaVA records that use them (reused if there)."""
    import random

    import numpy as np
    from PIL import Image

    from llava_mix import PARTS, _corpus, _record

    annotation, root, done = folder / "llava.json", folder / "images", folder / "DONE"
    spec = {"images": images, "records": records, "version": 1}
    if done.is_file() and json.loads(done.read_text()) == spec:
        return annotation, root
    (root / "coco/train2017").mkdir(parents=True, exist_ok=True)
    rng, np_rng = random.Random(0), np.random.default_rng(0)
    for k in range(images):
        field = np_rng.random((6, 8, 3)) * 255  # a smooth colour field, upsampled, with sensor-like noise
        smooth = np.asarray(Image.fromarray(field.astype(np.uint8)).resize((640, 480), Image.BICUBIC), np.float32)
        pixels = np.clip(smooth + np_rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"coco/train2017/{k:012d}.jpg", quality=90)
    corpus = _corpus(rng)
    parts = [p for p in PARTS if p.folder == "coco/train2017"]
    items = []
    for n in range(records):
        record = _record(rng, corpus, rng.choice(parts), n, 0)
        record["image"] = f"coco/train2017/{n % images:012d}.jpg"
        items.append(record)
    annotation.write_text(json.dumps(items))
    done.write_text(json.dumps(spec))
    return annotation, root


def section(annotation: Path, root: Path, image_size: int) -> dict:
    return {"builder": "llava_conversation",
            "build_info": {"annotations": {"train": {"storage": str(annotation)}}, "images": {"storage": str(root)}},
            "vis_processor": {"train": {"name": "blip2_image_train", "image_size": image_size},
                              "eval": {"name": "blip2_image_eval", "image_size": image_size}}}


def build_trainer(cfg_path: Path):
    from lavis_ds.build import build_trainer as build
    from lavis_ds.common.registry import registry
    from lavis_ds.config import load_config

    cfg = load_config(cfg_path, world_size=1)
    registry.get_engine_class(cfg.run.runner).setup.init_process_group()
    trainer = build(cfg)
    trainer.setup()  # the engine, the data order and the hooks, as train() starts
    trainer.call_hooks("before_train")  # the logging hook opens its writer here, as train() does
    trainer.engine.module.train()
    return trainer


def step_time(trainer, steps: int) -> float:
    """Median seconds of the trainer's optimizer step on micro-batches read beforehand."""
    loader = trainer.data.epoch(0, 0)
    batches = [trainer.data.next_step(loader) for _ in range(min(4, trainer.data.steps_per_epoch))]
    times = []
    for i in range(3 + steps):
        start = time.perf_counter()
        trainer.run_step(batches[i % len(batches)])
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def loader_rate(trainer, dataset, workers: int, batches: int) -> tuple[float, float]:
    """(seconds to the first batch, samples/s over the next ``batches``) of the trainer's training DataLoader."""
    from lavis_ds.datasets.samplers import StepBatchSampler

    trainer.run.num_workers = workers
    from lavis_ds.runners.data import make_loader

    sampler = StepBatchSampler(len(dataset), trainer.plan.micro_batch, 1, 1, 0, seed=trainer.run.seed)
    start = time.perf_counter()
    iterator = iter(make_loader(dataset, sampler, trainer.run))
    next(iterator)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    samples = 0
    for _ in range(batches):
        samples += len(next(iterator)["index"])
    rate = samples / (time.perf_counter() - start)
    del iterator  # ends the workers
    return first_s, rate


def main(argv=None) -> int:
    args = parse_args(argv)
    # One thread per process, as torchrun sets it and as the step-time figures in docs/benchmarks.md were taken.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from lavis_ds.common import dist

    dist.set_single_process_defaults()
    import deepspeed
    import logging

    importlib.import_module("lavis_ds")  # fills the registries
    from lavis_ds.common.seeding import SeededDataset
    from lavis_ds.datasets import LlavaConversationBuilder
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

    from harness.configs import tiny_config, write_yaml

    deepspeed.utils.logger.setLevel(logging.WARNING)
    annotation, root = write_data(args.data, args.images, args.records)
    storage = ensure_demo_shapes(args.data / "demo_shapes", DemoShapesSpec(num_train=128, num_val=16, num_test=8))  # tiny_config's
    with tempfile.TemporaryDirectory(prefix="loader_throughput_") as tmp:
        cfg = tiny_config(Path(tmp) / "out", storage, stage=2, micro=args.micro, max_epoch=100, log_freq=1000)
        trainer = build_trainer(write_yaml(Path(tmp) / "run.yaml", cfg))
        step = step_time(trainer, args.steps)
        need = trainer.plan.micro_batch * trainer.plan.accum / step
        print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; tiny BLIP2-Qwen demo step "
              f"(micro-batch {trainer.plan.micro_batch}, 64-pixel images, one process): {step * 1000:.0f} ms -> it "
              f"consumes {need:.0f} samples/s")
        print(f"{'image':>6} {'workers':>8} {'first batch s':>14} {'samples/s':>10} {'x the tiny step needs':>22} "
              f"{'load':>5}")
        for size in (64, 224):
            dataset = SeededDataset(LlavaConversationBuilder(section(annotation, root, size)).build()["train"],
                                    trainer.run.seed)
            for workers in (int(w) for w in args.workers.split(",")):
                first_s, rate = loader_rate(trainer, dataset, workers, args.batches)
                print(f"{size:>6} {workers:>8} {first_s:>14.2f} {rate:>10.0f} {rate / need:>22.2f} "
                      f"{os.getloadavg()[0]:>5.1f}", flush=True)
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
