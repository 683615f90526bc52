"""Peak memory of one large image through a Qwen-VL tower: attention per span (lavis_ds) against the dense-mask SDPA
path (transformers 4.x's ``VisionSdpaAttention``), side by side in one run.

    python benchmarks/qwen_vl_tower_memory.py [--side 128] [--arch qwen2_5_vl] [--depth 2] [--paths span dense]

The tower is the published preset's width (``qwen2_5_vl`` 3B / ``qwen2_vl`` 2B: 1280 wide, 16 heads, random
weights) cut to ``--depth`` blocks; for Qwen2.5-VL the last of them attends fully and the others within 112 px
windows, as in the published towers (whose blocks 7, 15, 23, 31 attend fully). The image is ``--side`` x ``--side``
patches (128: 16,384 patches, a 1792 x 1792 px image), forward without gradients (fp32 on a CPU, bf16 on a GPU).

Paths, on the same built tower and the same patches, alternating ``--repeats`` times:
  span: the tower as it is: ``scaled_dot_product_attention`` per group of equal-length spans (flash-attn's varlen
      kernel instead where it is installed, on a GPU, in fp16/bf16), no mask.
  dense: the same tower with its attention replaced by what transformers 4.x's Qwen2-VL / Qwen2.5-VL SDPA path
      did: a ``[1, N, N]`` boolean mask, True within each span, and one SDPA call over all N patches with it.
      (transformers 5's SDPA path splits per span as well.)

Each forward runs in a process of its own (built the same way, same seed): on a CPU the allocator keeps what one
forward freed and the next reuses it, so two paths in one process would not each show their own peak. What is
measured, above what the process holds just before the forward (the tower, the patches): on a GPU
``torch.cuda.max_memory_allocated()``; on a CPU the resident set size sampled every 1 ms (``logits_memory.PeakRSS``),
an upper bound of the tensors' peak. The two paths' outputs are compared (max abs difference).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from logits_memory import PeakRSS  # noqa: E402

MIB = 2 ** 20


def dense_mask_attend(spans, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """transformers 4.x's Qwen2-VL ``VisionSdpaAttention``: a boolean ``[1, N, N]`` mask, one SDPA over all rows."""
    n = q.shape[0]
    cu = spans.cu_seqlens.tolist()
    mask = torch.zeros([1, n, n], device=q.device, dtype=torch.bool)
    for start, end in zip(cu[:-1], cu[1:]):
        mask[..., start:end, start:end] = True
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask)
    return out.transpose(0, 1)


def build(arch: str, depth: int, device: torch.device, dtype: torch.dtype):
    from lavis_ds.common.registry import vision_towers

    import lavis_ds  # noqa: F401  (fills the registries)

    if arch == "qwen2_5_vl":
        tower = vision_towers.get(arch)(preset="3b", vision_config={"depth": depth,
                                                                   "fullatt_block_indexes": [depth - 1]})
    else:
        tower = vision_towers.get(arch)(preset="2b", vision_config={"depth": depth})
    return tower.to(device=device, dtype=dtype).eval()


def measure(tower, pixels: torch.Tensor, grid: torch.Tensor, path: str) -> tuple[float, float, torch.Tensor]:
    """(MiB added at the peak, seconds, output) of one forward on ``path``."""
    from lavis_ds.models.towers import qwen_vl_layers

    original = qwen_vl_layers.Spans.attend
    if path == "dense":
        qwen_vl_layers.Spans.attend = dense_mask_attend
    try:
        with torch.no_grad():
            if pixels.is_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start = time.perf_counter()
                out = tower(pixels, grid)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                added = torch.cuda.max_memory_allocated() - base
            else:
                with PeakRSS() as rss:
                    start = time.perf_counter()
                    out = tower(pixels, grid)
                    seconds = time.perf_counter() - start
                added = rss.added
    finally:
        qwen_vl_layers.Spans.attend = original
    return added / MIB, seconds, out.float().cpu()


def child(args: argparse.Namespace) -> None:
    """One forward on ``args.child`` in this process: prints its figures as JSON, saves its output."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    tower = build(args.arch, args.depth, device, dtype)
    grid = torch.tensor([[1, args.side, args.side]], device=device)
    pixels = torch.randn(args.side * args.side, 3 * 2 * 14 * 14, device=device, dtype=dtype)
    added, seconds, out = measure(tower, pixels, grid, args.child)
    torch.save(out, args.output)
    lengths = sorted({max(spans) for spans in tower.attention_plan(grid.cpu())[1]})
    print(json.dumps({"added": added, "seconds": seconds, "device": str(device), "dtype": str(dtype),
                      "spans": lengths}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=128, help="patches per side (even); 128: 16,384 patches")
    parser.add_argument("--arch", choices=("qwen2_5_vl", "qwen2_vl"), default="qwen2_5_vl")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--paths", nargs="+", choices=("span", "dense"), default=["span", "dense"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", choices=("span", "dense"), help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    patches = args.side * args.side
    with tempfile.TemporaryDirectory(prefix="qwen_vl_tower_memory_") as tmp:
        folder = Path(tmp)  # each child's output, compared at the end
        results: dict[str, list[dict]] = {path: [] for path in args.paths}
        for repeat in range(args.repeats):
            for path in args.paths:
                figures = run_child(args, path, folder / f"{path}.pt")
                results[path].append(figures)
                if repeat == 0 and path == args.paths[0]:
                    print(f"{args.arch}, {args.depth} block(s) (longest span per block kind: {figures['spans']}), "
                          f"{patches} patches ({args.side * 14} x {args.side * 14} px), {figures['dtype']}, "
                          f"{figures['device']}")
                print(f"  {path}: {figures['added']:.0f} MiB added, {figures['seconds']:.1f} s", flush=True)
        print("\n| path | added MiB (median) | forward s (median) |\n|---|---|---|")
        medians = {path: (statistics.median(r["added"] for r in runs), statistics.median(r["seconds"] for r in runs))
                   for path, runs in results.items()}
        for path, (added, seconds) in medians.items():
            print(f"| {path} | {added:.0f} | {seconds:.1f} |")
        if len(medians) == 2:
            difference = (torch.load(folder / "dense.pt") - torch.load(folder / "span.pt")).abs().max().item()
            print(f"\ndense / span memory: {medians['dense'][0] / max(medians['span'][0], 1e-9):.1f}x; "
                  f"outputs differ by {difference:.2e} (max abs)")
    return 0


def run_child(args: argparse.Namespace, path: str, output: Path) -> dict:
    """One forward on ``path`` in a fresh process (``child``): its figures; its output saved to ``output``."""
    command = [sys.executable, __file__, "--side", str(args.side), "--arch", args.arch, "--depth", str(args.depth),
               "--child", path, "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:  # the child's own error, not a bare CalledProcessError
        raise RuntimeError(f"the {path} forward failed ({done.returncode}): {' '.join(command)}\n"
                           f"{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
