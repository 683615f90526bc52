"""How closely runner_fsdp follows runner_deepspeed: per-step losses of the same run on both, side by side.

Runs the tiny demo model on 2 processes (torchrun, CPU) from the same seed: fp32 on FSDP2, ZeRO-2 and
ZeRO-3; bf16 on FSDP2 `mixed`, FSDP2 `low` and ZeRO-2. Prints the largest and mean relative loss
difference against DeepSpeed and the mean loss of the last 8 steps of each curve.

    python benchmarks/engine_agreement.py --epochs 3 --out /tmp/engine_agreement
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the harness, shared with the tests

from harness.checks import train_steps  # noqa: E402
from harness.configs import tiny_config, write_yaml  # noqa: E402
from harness.processes import command, env  # noqa: E402

RUNS = {  # name -> (engine, ZeRO stage, precision, run.fsdp)
    "fp32 fsdp": ("runner_fsdp", 3, "fp32", {}),
    "fp32 zero2": ("runner_deepspeed", 2, "fp32", {}),
    "fp32 zero3": ("runner_deepspeed", 3, "fp32", {}),
    "bf16 fsdp mixed": ("runner_fsdp", 3, "bf16", {"precision_mode": "mixed"}),
    "bf16 fsdp low": ("runner_fsdp", 3, "bf16", {"precision_mode": "low"}),
    "bf16 zero2": ("runner_deepspeed", 2, "bf16", {}),
}
COMPARED = [("fp32 fsdp", "fp32 zero2"), ("fp32 fsdp", "fp32 zero3"), ("bf16 fsdp mixed", "bf16 zero2"),
            ("bf16 fsdp low", "bf16 zero2")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/engine_agreement"))
    args = parser.parse_args()

    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

    storage = ensure_demo_shapes(args.out / "demo_shapes", DemoShapesSpec(num_train=128, num_val=16, num_test=8))
    losses = {}
    for name, (engine, stage, dtype, fsdp) in RUNS.items():
        out = args.out / name.replace(" ", "_")
        cfg = tiny_config(out, storage, stage=stage, dtype=dtype, runner=engine, max_epoch=args.epochs,
                          resume=False, **({"fsdp": fsdp} if fsdp else {}))
        subprocess.run(command(write_yaml(args.out / f"{out.name}.yaml", cfg)), cwd=REPO, env=env(), check=True,
                       capture_output=True)
        losses[name] = [m["loss"] for m in train_steps(out)]
    print(f"{'run':18} {'against':12} {'steps':>5} {'max rel':>9} {'mean rel':>9} {'first 20 max':>12}")
    for mine, theirs in COMPARED:
        rel = [abs(a - b) / b for a, b in zip(losses[mine], losses[theirs])]
        print(f"{mine:18} {theirs:12} {len(rel):5d} {max(rel):9.2e} {sum(rel) / len(rel):9.2e} {max(rel[:20]):12.2e}")
    print(json.dumps({name: round(sum(curve[-8:]) / 8, 4) for name, curve in losses.items()}))


if __name__ == "__main__":
    main()
