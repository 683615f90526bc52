"""Host memory per process while the model is built and sharded: the LLM built partitioned from the start
(ZeRO-3: zero.Init; FSDP2: meta device on processes other than 0) against built whole on every process,
measured side by side in one run; and the same on paper for Qwen2.5-7B and -72B, 8 processes per node.

    python benchmarks/build_memory.py [--nproc 2] [--hidden 1536] [--layers 16] [--workdir DIR]
    python benchmarks/build_memory.py --on-paper [--nproc 8]

Measured. A scaled-down Qwen2 LLM (default: hidden 1536, 16 layers, MLP 4224, vocabulary 32,000, untied:
~0.5B parameters, 1.0 GB in bf16) is written with `save_pretrained` in bf16, next to a ChatML tokenizer;
the model is our real tiny BLIP2-Qwen with that folder as `llm_model` (the LLM is >95% of its weights),
every part frozen but the projection (the MiniGPT4Qwen recipe), bf16 engine. For each engine
(runner_deepspeed at ZeRO-3, runner_fsdp) and each build (in the engine's `setup.model_placement`, or whole on
every process), `torchrun --nproc_per_node=<nproc>` starts fresh processes that do what train.py
does: start the process group, build the model, build the trainer (the engine shards the model; FSDP's
processes receive their shards there). Each process samples its resident set size (psutil, every 2 ms, in
a thread) from just before the build to the end of the trainer's construction, and reports, above its RSS
just before the build (imports and process group already paid):
  peak while building   the highest RSS while the model is built (and, ZeRO-3, loaded);
  peak until sharded    the highest RSS from the build to the engine holding the model (FSDP's processes
                        receive their shards there): what the process must have room for;
  after                 its RSS once the engine holds the model.
RSS counts every resident page, including file pages mapped while reading safetensors; the figures are
MB (10^6 bytes), the LLM's size in the folder is printed above the table, and `whole / partitioned`
is the ratio of the two builds' peaks for the same process.

On paper (--on-paper): what each process holds in host memory while the LLM is built and loaded, from the
parameter counts of our Blip2Qwen with the LLM architectures (built on the meta device; Qwen2.5-7B from
the qwen2.5_7b_instruct preset, Qwen2.5-72B-Instruct's config.json values), bf16 weights, --nproc processes
sharding the model (one node of 8 by default). See docs/memory.md for the assumptions.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

MB, GB = 1e6, 1e9
BUILDS = (("runner_deepspeed", "whole"), ("runner_deepspeed", "partitioned"),
          ("runner_fsdp", "whole"), ("runner_fsdp", "partitioned"))


# ---------------------------------------------------------------------------------------------- measured
class PeakRSS:
    """This process's resident set size, sampled in a thread between ``start`` and ``stop``."""

    def __init__(self, interval: float = 0.002):
        import psutil

        self.process, self.interval, self.peak = psutil.Process(), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.before = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.rss()
        self.peak = max(self.peak, self.after)


def worker(cfg_path: str, engine_name: str, build: str, report: str) -> None:
    """One process of a measured launch (under torchrun)."""
    import contextlib

    import torch.distributed as torch_dist

    importlib.import_module("lavis_ds")  # fills the registries
    from lavis_ds.build import build_datasets, build_model
    from lavis_ds.common.registry import registry
    from lavis_ds.config import load_config
    from lavis_ds.runners import Trainer

    cfg = load_config(cfg_path, [f"run.runner={engine_name}"], world_size=int(os.environ["WORLD_SIZE"]))
    engine_class = registry.get_engine_class(engine_name)
    engine_class.setup.prepare_process(cfg)
    engine_class.setup.init_process_group()
    datasets = build_datasets(cfg.datasets)
    torch_dist.barrier()
    placement = engine_class.setup.model_placement(cfg) if build == "partitioned" else contextlib.nullcontext()
    with PeakRSS() as rss:
        with PeakRSS() as building:
            model = build_model(cfg.model, cfg.run.seed, placement)
        trainer = Trainer.from_config(cfg, model, datasets)
        trainer.setup()  # wraps the model: the engine's start is part of what is measured
    mine = {"built": building.peak - rss.before, "peak": rss.peak - rss.before, "after": rss.after - rss.before,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    everyone = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(everyone, mine)
    if torch_dist.get_rank() == 0:
        Path(report).write_text(json.dumps(everyone))
    del trainer


def write_run(workdir: Path, hidden: int, layers: int, vocab: int) -> tuple[Path, int]:
    """The LLM folder, the demo data and the run YAML; returns (YAML, bytes of the LLM's weights)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
    from lavis_ds.models.tokenizer import train_chatml_tokenizer

    storage = ensure_demo_shapes(workdir / "demo_shapes", DemoShapesSpec(num_train=8, num_val=2, num_test=2))
    llm_dir = workdir / "llm"
    if not (llm_dir / "config.json").is_file():
        train_chatml_tokenizer(["You are a helpful assistant.", "What is in the image?"], llm_dir, vocab_size=300)
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,  # Qwen's ratio
                             num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(llm_dir)
    weights = sum(p.stat().st_size for p in llm_dir.glob("*.safetensors"))
    from harness.configs import tiny_config, write_yaml

    cfg = tiny_config(workdir / "out", storage, stage=3, dtype="bf16", micro=2)
    cfg["model"].update(llm_model=str(llm_dir), tokenizer=None, freeze_vit=True, freeze_qformer=True,
                        freeze_queries=True, freeze_llm=True)
    return write_yaml(workdir / "run.yaml", cfg), weights


def measure(cfg_path: Path, nproc: int, workdir: Path) -> dict:
    results = {}
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for engine, build in BUILDS:
        report = workdir / f"{engine}_{build}.json"
        port = 29000 + os.getpid() % 1000
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={port}", __file__, "--worker", str(cfg_path), engine, build, str(report)]
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{engine} {build} failed:\n{proc.stderr[-4000:]}")
        results[(engine, build)] = json.loads(report.read_text())
    return results


def measured_table(results: dict, weights: int, nproc: int) -> str:
    lines = [f"LLM weights in the folder: {weights / MB:.0f} MB (bf16); {nproc} processes. MB above each "
             "process's RSS just before the build.", "",
             "| engine | process | build | peak while building | peak until sharded | after | "
             "whole / partitioned (peak until sharded) |", "|---|---|---|---|---|---|---|"]
    for engine in ("runner_deepspeed", "runner_fsdp"):
        for rank in range(nproc):
            whole, part = results[(engine, "whole")][rank], results[(engine, "partitioned")][rank]
            for build, r in (("whole", whole), ("partitioned", part)):
                ratio = f"{whole['peak'] / max(part['peak'], 1):.2f}" if build == "partitioned" else ""
                lines.append(f"| {engine} | {rank} | {build} | {r['built'] / MB:.0f} | {r['peak'] / MB:.0f} | "
                             f"{r['after'] / MB:.0f} | {ratio} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- on paper
QWEN25_72B = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)


def counts(llm_config: dict | None) -> dict:
    """Parameters of our Blip2Qwen (the 7B preset's ViT and Q-Former) with the given LLM, on the meta device."""
    import torch

    from lavis_ds.models import Blip2Qwen
    from lavis_ds.models.tokenizer import train_chatml_tokenizer

    cfg = Blip2Qwen.default_config("qwen2.5_7b_instruct")
    if llm_config:
        cfg["llm_config"] = {**cfg["llm_config"], **llm_config}
    with tempfile.TemporaryDirectory() as tmp:
        cfg.update(tokenizer=str(train_chatml_tokenizer(["You are a helpful assistant."], tmp, vocab_size=300)),
                   load_pretrained=False, pretrained=None)
        with torch.device("meta"):
            model = Blip2Qwen.from_config(cfg)
    llm = model.llm_model
    return {"llm": sum(p.numel() for p in llm.parameters()),
            "largest": max(p.numel() for p in llm.parameters()),  # the embedding / lm_head matrix
            "vit": sum(p.numel() for p in model.vision_tower.parameters()),
            "bridge": sum(p.numel() for p in model.connector.parameters())}


def on_paper(nproc: int) -> str:
    lines = [f"GB (10^9 bytes) of host memory per process while the LLM is built and loaded, {nproc} processes "
             "sharding it; bf16 LLM weights (2 bytes), ViT in fp16 (2 bytes), Q-Former, queries and projection "
             "in fp32 (4 bytes): these are built whole on every process in every row.", "",
             "| LLM | engine | build | process 0 | each other process | all processes of the node |",
             "|---|---|---|---|---|---|"]
    for name, config in (("Qwen2.5-7B", None), ("Qwen2.5-72B", QWEN25_72B)):
        c = counts(config)
        llm, largest = 2 * c["llm"], 2 * c["largest"]
        rest = 2 * c["vit"] + 4 * c["bridge"]
        share = llm / nproc
        rows = [
            ("runner_deepspeed", "whole", llm + rest, llm + rest),
            # transformers 5.23 reads every shard file of the folder into one dict on process 0, then copies
            # module by module into the partitions; the others gather one module at a time.
            ("runner_deepspeed", "ZeRO-3 partitioned", llm + share + rest, share + largest + rest),
            ("runner_fsdp", "whole", llm + rest, llm + rest),
            # process 0 keeps its whole model until every tensor is broadcast; the others receive one at a time.
            ("runner_fsdp", "meta on processes > 0", llm + share + rest, share + largest + rest),
        ]
        for engine, build, first, other in rows:
            lines.append(f"| {name} ({c['llm'] / 1e9:.2f}B) | {engine} | {build} | {first / GB:.1f} | "
                         f"{other / GB:.1f} | {(first + (nproc - 1) * other) / GB:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None, help="processes (measured: 2; on paper: 8)")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the LLM folder and reports here")
    parser.add_argument("--on-paper", action="store_true")
    parser.add_argument("--worker", nargs=4, metavar=("CFG", "RUNNER", "BUILD", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.on_paper:
        print(on_paper(args.nproc or 8))
        return 0
    nproc = args.nproc or 2
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        cfg_path, weights = write_run(workdir, args.hidden, args.layers, args.vocab)
        print(measured_table(measure(cfg_path, nproc, workdir), weights, nproc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
