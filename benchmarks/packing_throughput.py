"""Useful (supervised) tokens/s of padded, length-grouped and packed batching, side by side in one run.

    python benchmarks/packing_throughput.py [--records 512] [--micro 8] [--accum 2] [--steps 8] [--max-len 1024]

Data: LLaVA-1.5 conversation records with the lengths of llava_v1_5_mix665k.json's image parts
(``benchmarks/llava_mix.py``'s shapes: VQA parts with up to 20 short question/answer pairs,
detail and reasoning parts with answers of several hundred characters, conversations in
between), written once by ``loader_throughput.write_data``. The model is the tiny BLIP2-Qwen
of the demo with the MiniGPT4Qwen recipe (ViT and Q-Former frozen) and a wider LLM (``--llm-width``,
4 layers), so that, as in a full-size model, the LLM's per-token work dominates a step; one process,
ZeRO-2, fp32, ``model.max_txt_len`` = ``--max-len``, with a byte-level BPE tokenizer of 8k tokens
trained on the records' text (``corpus_tokenizer``).

Four trainers are built from the same YAML, differing only in ``run.packing`` /
``run.length_grouped`` / ``run.batch_unit``: padded and length-grouped micro-batches of ``--micro``
samples; packed, the same ``--micro`` samples laid into rows (``batch_unit: samples``); and packed
by a token budget (``batch_unit: tokens``, packing's default), micro-batches of as many samples as
fill R rows of ``--max-len``, with R chosen so that a micro-batch holds about the tokens of
``--micro`` samples (from the padded batches' real tokens). Each reads its micro-batches up front
through its own sampler and DataLoader, and prepares them on the host (tokenizing; packing) before
anything is timed, so data loading and tokenizing are in none of the timings. Then the four
alternate in blocks of ``--block`` optimizer steps (``trainer.run_step``), so that changing machine
load hits all alike. Reported per mode: supervised tokens per second (answer tokens the loss is
summed over), all positions per second, the padding share (positions that hold no token / all
positions) and the speed-up over padded. Nothing is asserted; figures go to docs/benchmarks.md.
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

MODES = {"padded": {}, "length_grouped": {"length_grouped": True},
         "packed (samples)": {"packing": True, "batch_unit": "samples"}, "packed (tokens)": {"packing": True}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("LAVIS_DS_CACHE", Path.home() / ".cache" / "lavis_ds"))
    parser.add_argument("--data", type=Path, default=cache / "packing_throughput", help="where the data is written")
    parser.add_argument("--records", type=int, default=512, help="records of the annotation file")
    parser.add_argument("--micro", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per mode")
    parser.add_argument("--block", type=int, default=2, help="optimizer steps per block")
    parser.add_argument("--max-len", type=int, default=1024, help="model.max_txt_len and the packed row length")
    parser.add_argument("--llm-width", type=int, default=256,
                        help="the LLM's hidden size (4 layers, MLP 11/4 of it): wide enough that its per-token work, "
                             "not per-sample overhead, dominates a step, as in a full-size model")
    return parser.parse_args(argv)


def build(cfg: dict, tmp: Path, name: str, micro: int, **run):
    from loader_throughput import build_trainer
    from harness.configs import write_yaml

    folder = "_".join(name.replace("(", "").replace(")", "").split())  # "packed (tokens)" -> packed_tokens
    cfg = {**cfg, "run": {**cfg["run"], "output_dir": str(tmp / folder), "batch_size_train": micro, **run}}
    return build_trainer(write_yaml(tmp / f"{folder}.yaml", cfg))


def prepared_steps(trainer, steps: int) -> tuple[list[list[dict]], list[tuple[int, int, int]]]:
    """``steps`` optimizer steps of micro-batches, prepared on the host, and per step (supervised tokens, token
    positions that hold a token, all positions, samples)."""
    loader = trainer.data.epoch(0, 0)
    batches, counts = [], []
    for _ in range(steps):
        step = trainer.data.next_step(loader)
        batches.append(step)
        counts.append((sum(trainer.engine.module.supervised_tokens(b) for b in step),
                       sum(int(b["attention_mask"].sum()) for b in step),
                       sum(b["input_ids"].numel() for b in step), sum(len(b["instruction"]) for b in step)))
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
    from harness.configs import tiny_config

    deepspeed.utils.logger.setLevel(logging.WARNING)
    annotation, root = write_data(args.data, 8, args.records)
    storage = ensure_demo_shapes(args.data / "demo_shapes", DemoShapesSpec(num_train=128, num_val=16, num_test=8))
    tokenizer = corpus_tokenizer(annotation, args.data / f"tokenizer_{args.records}")
    with tempfile.TemporaryDirectory(prefix="packing_throughput_") as tmp:
        cfg = tiny_config(Path(tmp) / "out", storage, micro=args.micro, accum=args.accum, max_epoch=100,
                          log_freq=10**6, max_seq_len=args.max_len)
        # The MiniGPT4Qwen recipe (vision side frozen) on an LLM whose per-token work dominates
        width = args.llm_width
        cfg["model"].update(max_txt_len=args.max_len, tokenizer=str(tokenizer), freeze_vit=True, freeze_qformer=True,
                            llm_config={"hidden_size": width, "num_hidden_layers": 4, "num_attention_heads": width // 64,
                                        "num_key_value_heads": max(1, width // 128), "intermediate_size": width * 11 // 4,
                                        "max_position_embeddings": args.max_len, "tie_word_embeddings": False})
        cfg["datasets"] = {"llava": section(annotation, root, 64)}
        trainers, data = {}, {}
        for name, run in MODES.items():
            micro = args.micro
            if name == "packed (tokens)":  # rows holding about the tokens of --micro samples
                real = sum(c[1] for c in data["padded"][1]) / (args.steps * args.accum)
                micro = max(1, round(real / args.max_len))
            trainers[name] = build(cfg, Path(tmp), name, micro, **run)
            data[name] = prepared_steps(trainers[name], args.steps)
        args.rows = micro
        times = {name: [] for name in MODES}
        for name, trainer in trainers.items():  # warm-up: one step each
            trainer.run_step(data[name][0][0])
        for block in range(args.steps // args.block):
            for name, trainer in trainers.items():
                for s in range(block * args.block, (block + 1) * args.block):
                    start = time.perf_counter()
                    trainer.run_step(data[name][0][s])
                    times[name].append(time.perf_counter() - start)
        for trainer in trainers.values():
            trainer.close()
    report(args, data, times)
    return 0


def corpus_tokenizer(annotation: Path, folder: Path) -> Path:
    """A byte-level BPE of 8k tokens trained on the records' own text, so that a sample has about as many tokens
    per word as a real LLM tokenizer gives English (the demo's tokenizer knows only the demo's words)."""
    import json

    from lavis_ds.models.tokenizer import train_chatml_tokenizer

    if not (folder / "tokenizer.json").is_file():
        texts = [turn["value"] for record in json.loads(annotation.read_text()) for turn in record["conversations"]]
        train_chatml_tokenizer(texts, folder, vocab_size=8192)
    return folder


def report(args, data: dict, times: dict) -> None:
    print(f"\npadded, length-grouped and packed batching: tiny BLIP2-Qwen (vision frozen, LLM width {args.llm_width}, "
          f"4 layers), one process, micro-batch {args.micro} "
          f"samples (packed by tokens: {args.rows} rows) x accumulation {args.accum}, max_txt_len {args.max_len}, "
          f"LLaVA-665k image-part lengths; {args.steps} timed steps per mode in alternating blocks of {args.block}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'mode':<18}{'supervised tok/s':>18}{'positions/s':>13}{'padding share':>15}{'median step ms':>16}"
          f"{'samples/step':>14}{'x padded':>10}")
    base = None
    for name in MODES:
        counts, seconds = data[name][1][:len(times[name])], sum(times[name])
        supervised, real, positions, samples = (sum(c[k] for c in counts) for k in range(4))
        rate = supervised / seconds
        base = base or rate
        print(f"{name:<18}{rate:>18.0f}{positions / seconds:>13.0f}{1 - real / positions:>15.3f}"
              f"{statistics.median(times[name]) * 1000:>16.0f}{samples / len(counts):>14.1f}{rate / base:>10.2f}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
