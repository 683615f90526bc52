"""GPU throughput of full-size BLIP2-Qwen recipes: samples/s, tokens/s, MFU and peak memory per engine, each beside a
hand-written loop on the same engine in the same run.

    python benchmarks/gpu_throughput.py                              # on a GPU machine: 1.5B and 7B, 3 engines
    python benchmarks/gpu_throughput.py --llms tiny --engines zero2 --steps 4 --micro 2   # a CPU smoke run

For each LLM preset (``--llms``: ``qwen2.5_1.5b_instruct``, ``qwen2.5_7b_instruct``; weights randomly
initialised, as no download is possible) and engine (``--engines``: ZeRO-2, ZeRO-3, FSDP2; bf16 on a
GPU), ``benchmarks/step_time.py`` runs in its own process (one process per GPU, ``--nproc``): the
trainer's ``run_step`` and a hand-written loop on the same engine, the same model, optimizer groups and
micro-batches, alternating in blocks. The model is the MiniGPT4Qwen recipe: EVA-ViT-G (frozen,
224 px), BLIP-2's Q-Former (frozen), the trained projection, the frozen LLM. The data are LLaVA-1.5
conversation records with the lengths of llava_v1_5_mix665k.json's image parts
(``benchmarks/llava_mix.py``), up to ``--max-len`` tokens each.

Reported per run: the median optimizer step of the trainer and of the raw loop and their ratio (the
trainer's overhead), samples/s and tokens/s of the trainer, achieved TFLOP/s per device and MFU (FLOPs
from ``lavis_ds.models.flops``: the formula is in docs/throughput.md; the peak from
``lavis_ds.common.hardware``: dense bf16 of A100/H100/H200), and the peak memory. Figures go to
docs/benchmarks.md; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

ENGINES = {"zero2": ("runner_deepspeed", 2), "zero3": ("runner_deepspeed", 3), "fsdp": ("runner_fsdp", 3)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("LAVIS_DS_CACHE", Path.home() / ".cache" / "lavis_ds"))
    parser.add_argument("--data", type=Path, default=cache / "gpu_throughput", help="where the data is written")
    parser.add_argument("--llms", default="qwen2.5_1.5b_instruct,qwen2.5_7b_instruct", help="blip2_qwen presets")
    parser.add_argument("--engines", default="zero2,zero3,fsdp", help=f"of {', '.join(ENGINES)}")
    parser.add_argument("--micro", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--max-len", type=int, default=1024, help="model.max_txt_len")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per loop")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs)")
    parser.add_argument("--options", nargs="*", default=[], help="more config overrides, e.g. model.llm_grad_checkpoint=true")
    return parser.parse_args(argv)


def write_config(folder: Path, llm: str, args) -> Path:
    """The run YAML of one LLM preset: the recipe, LLaVA-length data at 224 px, the demo's tokenizer."""
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
    from lavis_ds.models import Blip2Qwen
    from loader_throughput import section, write_data
    from harness.configs import write_yaml

    annotation, root = write_data(args.data, 16, 8 * args.micro * args.nproc * 4)
    storage = ensure_demo_shapes(args.data / "demo_shapes", DemoShapesSpec(num_train=128, num_val=16, num_test=8))
    model = {**Blip2Qwen.default_config(llm), "tokenizer": f"{storage}/tokenizer", "max_txt_len": args.max_len}
    image_size = model.get("image_size", 224)
    return write_yaml(folder / f"{llm}.yaml", {
        "model": model, "datasets": {"llava": section(annotation, root, image_size)},
        "run": {"output_dir": str(folder / "out"), "init_lr": 1e-4, "log_freq": 10**6, "seed": 0,
                "batch_size_train": args.micro, "num_workers": 2, "precision": "bf16"}})


def run_one(cfg: Path, engine: str, args, out: Path) -> dict | None:
    engine_name, stage = ENGINES[engine]
    import torch

    dtype = "bf16" if torch.cuda.is_available() else "fp32"  # bf16 engines are GPU work; CPUs run the smoke test
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               str(REPO / "benchmarks/step_time.py"), "--cfg-path", str(cfg), "--runner", engine_name,
               "--stage", str(stage), "--dtype", dtype, "--steps", str(args.steps),
               "--block", str(max(1, args.steps // 4)), "--warmup", "2", "--distinct", "4", "--json", str(out),
               "--options", f"run.precision={dtype}", *args.options]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{cfg.stem} {engine}: failed ({proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(out.read_text())


def report(rows: list[tuple[str, str, dict]]) -> None:
    from lavis_ds.common.hardware import peak_bf16_tflops

    # The GPU's name as the runs saw it: this process never starts CUDA (each run is a torchrun of its own).
    name = rows[0][2].get("device", "CPU") if rows else "CPU"
    peak = peak_bf16_tflops(name)
    print(f"\n{name}; peak {peak or 'unknown'} TFLOP/s (dense bf16); medians of the timed steps")
    print(f"{'LLM':<24}{'engine':<8}{'trainer ms':>11}{'raw ms':>9}{'ratio':>7}{'samples/s':>11}{'tokens/s':>10}"
          f"{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}")
    for llm, engine, r in rows:
        step = r["trainer"]["median"]
        tflops = r["flops"] / step / 1e12  # this rank's work over the step: per device
        mfu = f"{tflops / peak:.1%}" if peak else "-"
        print(f"{llm:<24}{engine:<8}{step * 1e3:>10.1f}{r['raw']['median'] * 1e3:>9.1f}"
              f"{step / r['raw']['median']:>7.3f}{r['samples'] * r['world_size'] / step:>11.1f}"
              f"{r['tokens'] * r['world_size'] / step:>10.0f}{tflops:>9.1f}{mfu:>7}{r['peak_memory_gib']:>10.1f}",
              flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as tmp:
        for llm in args.llms.split(","):
            cfg = write_config(Path(tmp), llm, args)
            for engine in args.engines.split(","):
                result = run_one(cfg, engine, args, Path(tmp) / f"{llm}_{engine}.json")
                if result is not None:
                    rows.append((llm, engine, result))
    report(rows)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
