"""The cost of the per-step agreement: one all-reduce of four int64 (per stop signal the ranks that received it,
the ranks that failed to load, the step's supervised tokens).

    torchrun --nproc_per_node=2 benchmarks/stop_agreement.py [--calls 2000]

Times `lavis_ds.runners.faults.agree_on_step(0, None, [tokens])` - the exact call the loop makes once per
optimizer step - back to back on every rank after a warm-up, and prints the median and 90th percentile
per call on rank 0. Compare with a step of the tiny demo model (~0.3 s on 2 CPU processes,
docs/benchmarks.md) or of a real model (seconds). Printed, never asserted: shared machines are noisy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as torch_dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from lavis_ds.common import dist  # noqa: E402
from lavis_ds.runners import faults  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    dist.init_distributed()
    for _ in range(100):
        faults.agree_on_step(0, None, [1000])
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        faults.agree_on_step(0, None, [1000])
        times.append(time.perf_counter() - start)
    if torch_dist.get_rank() == 0:
        times.sort()
        print(f"agree_on_step(): {torch_dist.get_world_size()} processes ({torch_dist.get_backend()}), {args.calls} calls: "
              f"median {statistics.median(times) * 1e6:.0f} us, p90 {times[int(0.9 * len(times))] * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
