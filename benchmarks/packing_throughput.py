"""Useful (supervised) tokens/s of padded, length-grouped and packed batching, side by side in one run.

    python benchmarks/packing_throughput.py [--records 512] [--micro 8] [--steps 12] [--max-len 1024]

Data: LLaVA-1.5 conversation records with the lengths of llava_v1_5_mix665k.json's image parts
(``benchmarks/llava_mix.py``'s shapes: VQA parts with up to 20 short question/answer pairs,
detail and reasoning parts with answers of several hundred characters, conversations in
between), written once by ``loader_throughput.write_data``. The model is the tiny BLIP2-Qwen
of the demo (one process, ZeRO-2, fp32), ``model.max_txt_len`` = ``--max-len``.

Three runners are built from the same YAML, differing only in ``run.packing`` /
``run.length_grouped``. Each reads its micro-batches up front through its own sampler and
DataLoader, and prepares them on the host (tokenizing; packing into rows of ``--max-len``)
before anything is timed, so data loading and tokenizing are in none of the timings. Then the
three alternate in blocks of ``--block`` optimizer steps (``runner.run_step``), so that changing
machine load hits all alike. Reported per mode: supervised tokens per second (answer tokens
the loss is summed over: the same samples in every mode), all positions per second, the
padding share (positions that hold no token / all positions) and the speed-up over padded.
Nothing is asserted; figures go to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

MODES = {"padded": {}, "length_grouped": {"length_grouped": True}, "packed": {"packing": True}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("LAVIS_DS_CACHE", Path.home() / ".cache" / "lavis_ds"))
    parser.add_argument("--data", type=Path, default=cache / "packing_throughput", help="where the data is written")
    parser.add_argument("--records", type=int, default=512, help="records of the annotation file")
    parser.add_argument("--micro", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per mode")
    parser.add_argument("--block", type=int, default=2, help="optimizer steps per block")
    parser.add_argument("--max-len", type=int, default=1024, help="model.max_txt_len and the packed row length")
    return parser.parse_args(argv)


def build(cfg: dict, tmp: Path, name: str, **run):
    from loader_throughput import build_runner
    from run_utils import write_yaml

    cfg = {**cfg, "run": {**cfg["run"], "output_dir": str(tmp / name), **run}}
    return build_runner(write_yaml(tmp / f"{name}.yaml", cfg))


def prepared_steps(runner, steps: int) -> tuple[list[list[dict]], list[tuple[int, int, int]]]:
    """``steps`` optimizer steps of micro-batches, prepared on the host, and per step (supervised tokens, token
    positions that hold a token, all positions)."""
    runner.sampler.set_position(0, 0)
    loader = iter(runner.train_loader)
    batches, counts = [], []
    for _ in range(steps):
        step = [next(loader) for _ in range(runner.accum)]
        runner.prepare_micro_batches(step)
        batches.append(step)
        counts.append((sum(runner.module.supervised_tokens(b) for b in step),
                       sum(int(b["attention_mask"].sum()) for b in step),
                       sum(b["input_ids"].numel() for b in step)))
    return batches, counts


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
    from lavis_ds.common import dist

    dist.set_single_process_defaults()
    import deepspeed

    importlib.import_module("lavis_ds")
    from loader_throughput import section, write_data
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
    from run_utils import tiny_config

    deepspeed.utils.logger.setLevel(logging.WARNING)
    annotation, root = write_data(args.data, 8, args.records)
    storage = ensure_demo_shapes(args.data / "demo_shapes", DemoShapesSpec(num_train=128, num_val=16, num_test=8))
    with tempfile.TemporaryDirectory(prefix="packing_throughput_") as tmp:
        cfg = tiny_config(Path(tmp) / "out", storage, micro=args.micro, max_epoch=100, log_freq=10**6,
                          max_seq_len=args.max_len)
        cfg["model"]["max_txt_len"] = args.max_len
        cfg["datasets"] = {"llava": section(annotation, root, 64)}
        runners = {name: build(cfg, Path(tmp), name, **run) for name, run in MODES.items()}
        data = {name: prepared_steps(runner, args.steps) for name, runner in runners.items()}
        times = {name: [] for name in MODES}
        for name, runner in runners.items():  # warm-up: one step each
            runner.run_step(data[name][0][0])
        for block in range(args.steps // args.block):
            for name, runner in runners.items():
                for s in range(block * args.block, (block + 1) * args.block):
                    start = time.perf_counter()
                    runner.run_step(data[name][0][s])
                    times[name].append(time.perf_counter() - start)
        for runner in runners.values():
            runner.close()
    report(args, data, times)
    return 0


def report(args, data: dict, times: dict) -> None:
    print(f"\npadded, length-grouped and packed batching: tiny BLIP2-Qwen, one process, micro-batch {args.micro}, "
          f"max_txt_len {args.max_len}, LLaVA-665k image-part lengths; {args.steps} timed steps per mode in "
          f"alternating blocks of {args.block}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'mode':<16}{'supervised tok/s':>18}{'positions/s':>13}{'padding share':>15}{'median step ms':>16}"
          f"{'x padded':>10}")
    base = None
    for name in MODES:
        counts, seconds = data[name][1][:len(times[name])], sum(times[name])
        supervised, real, positions = (sum(c[k] for c in counts) for k in range(3))
        rate = supervised / seconds
        base = base or rate
        print(f"{name:<16}{rate:>18.0f}{positions / seconds:>13.0f}{1 - real / positions:>15.3f}"
              f"{statistics.median(times[name]) * 1000:>16.0f}{rate / base:>10.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
