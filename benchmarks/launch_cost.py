"""What one tiny 2-process training run costs the test suite, launched three ways, side by side.

    python benchmarks/launch_cost.py [--repeats 3]

The same run (the tiny BLIP2-Qwen, ZeRO-2 fp32, 12 optimizer steps on 64 demo images, a
checkpoint every 3 steps) is started alternately:
- ``torchrun``: `python -m torch.distributed.run --nproc_per_node=2 train.py ...`, as a user does;
- ``forked``: two processes forked from the suite's server that imported torch & co once
  (tests/forked.py), as most of the suite's runs are;
and the losses of both are checked equal. Prints wall seconds per run (median) and the ratio.
Most of a tiny run is Python start-up, which is what the forked launch saves.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness

from harness import forked  # noqa: E402
from harness.checks import comparable, train_steps  # noqa: E402
from harness.configs import noisy_config, write_yaml  # noqa: E402
from harness.processes import run_train  # noqa: E402

from lavis_ds.common.extensions import configure_build_environment  # noqa: E402
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    configure_build_environment()
    root = Path(tempfile.mkdtemp(prefix="launch_cost_"))
    storage = ensure_demo_shapes(root / "demo_shapes", DemoShapesSpec(num_train=64, num_val=16, num_test=8))

    start = time.perf_counter()
    forked._server().Process(target=time.sleep, args=(0,)).start()  # the server imports once per session
    server_seconds = time.perf_counter() - start

    seconds: dict[str, list[float]] = {"torchrun": [], "forked": []}
    curves = {}
    for i in range(args.repeats):
        for launcher, how in (("torchrun", "launch"), ("forked", "fork")):
            out = root / f"{launcher}{i}"
            cfg = write_yaml(root / f"{launcher}{i}.yaml", noisy_config(out, storage, 2, "fp32"))
            start = time.perf_counter()
            run_train(cfg, nproc=2, launcher=how)
            seconds[launcher].append(time.perf_counter() - start)
            curves[launcher] = comparable(train_steps(out))
    assert curves["torchrun"] == curves["forked"], "the two launches trained differently"

    print(f"server start-up (once per test session): {server_seconds:.1f} s")
    for launcher, values in seconds.items():
        print(f"{launcher:>8}: median {statistics.median(values):5.1f} s  ({', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(seconds["torchrun"]) / statistics.median(seconds["forked"])
    print(f"torchrun / forked: {ratio:.2f}  (same {len(curves['forked'])} losses, bit for bit)")


if __name__ == "__main__":
    main()
