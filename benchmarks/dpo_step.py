"""Time and memory of a DPO step against an SFT step of the same pairs, side by side in one run.

    python benchmarks/dpo_step.py [--tokens 512] [--pairs 4] [--repeats 3]

The model is the real tiny BLIP2-Qwen preset at Qwen's vocabulary (``logits_memory.build``: everything trains,
fp32). ``--pairs`` pairs of about ``--tokens`` tokens per side: one image, an instruction of about three quarters
of the tokens, two different answers of about a quarter. The paths alternate, ``--repeats`` times each, on the same
model; each is forward + backward:
  sft:  next-token SFT on the chosen sides (``pairs`` sequences): the model's forward.
  dpo:  DPO (precomputed reference log-probs in the batch): one vision pass for the pairs' images, both sides in one
        LLM forward (``2 x pairs`` sequences), the sigmoid loss (``lavis_ds.objectives.Dpo``).
  reference pass: what the precomputed reference costs once per pair before training: a forward of both sides
        without gradients (``objectives.reference.ReferenceScorer``).
Memory is measured as in ``logits_memory.py`` (GPU: max allocated; CPU: peak RSS sampled every 1 ms), above what
the process holds just before the step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logits_memory import GIB, PeakRSS, build, words  # noqa: E402  (beside this file)

from lavis_ds.objectives import Dpo  # noqa: E402
from lavis_ds.objectives.model_calls import prepare_pairs  # noqa: E402
from lavis_ds.objectives.reference import ReferenceScorer  # noqa: E402


def pairs_of(model, pairs: int, tokens: int, device: torch.device) -> dict:
    count = lambda text: len(model.llm.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    per_word = count(words(400, 0)) / 400
    question, answer = int(tokens * 0.75 / per_word) - 30, int(tokens * 0.25 / per_word)
    size = model.vision_tower.image_size
    return {"image": torch.randn(pairs, 3, size, size, device=device),
            "num_images": [1] * pairs, "instruction": [[f"<Img><ImageHere></Img> {words(question, i)}"]
                                                       for i in range(pairs)],
            "output": [[] for _ in range(pairs)], "chosen": [words(answer, 7 * i) for i in range(pairs)],
            "rejected": [words(answer, 7 * i + 3) for i in range(pairs)]}


def measured(device: torch.device, run) -> tuple[int, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, start = torch.cuda.memory_allocated(), time.perf_counter()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, time.perf_counter() - start
    with PeakRSS() as rss:
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
    return rss.added, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per side (about)")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args.tokens, device)
    raw = pairs_of(model, args.pairs, args.tokens, device)
    sft = model.prepare_batch({"image": raw["image"], "num_images": raw["num_images"],
                               "instruction": raw["instruction"], "output": [[c] for c in raw["chosen"]]})
    dpo, scorer = Dpo(beta=0.1, reference="precomputed"), ReferenceScorer()
    with torch.no_grad():
        logps = scorer(model, scorer.prepare(model, raw)).logps
    pair_batch = {**prepare_pairs(model, raw), "ref_chosen_logps": logps[:args.pairs],
                  "ref_rejected_logps": logps[args.pairs:]}

    def sft_step():
        model.zero_grad(set_to_none=True)
        model(sft)["loss"].backward()

    def dpo_step():
        model.zero_grad(set_to_none=True)
        sum(dpo(model, pair_batch).loss_sums.values()).backward()

    def reference_pass():
        with torch.no_grad():
            scorer(model, pair_batch)

    paths = {"sft (chosen sides)": sft_step, "dpo": dpo_step, "reference pass": reference_pass}
    for run in paths.values():
        run()  # warm-up
    results = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, run in paths.items():
            results[name].append(measured(device, run))
    memory = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS (psutil, 1 ms)"
    print(f"dpo step: tiny BLIP2-Qwen, vocabulary {model.llm.config.vocab_size:,}, fp32, {device.type}, "
          f"{torch.get_num_threads()} threads; {args.pairs} pairs x {tuple(sft['input_ids'].shape)[1]} tokens per "
          f"side; memory: {memory}, above the built model; forward + backward")
    base_mem, base_time = max(r[0] for r in results[next(iter(paths))]), statistics.median(
        r[1] for r in results[next(iter(paths))])
    print(f"{'path':<22}{'added GiB (max)':>16}{'x sft':>8}{'step s (median)':>17}{'x sft':>8}")
    for name, runs in results.items():
        added, seconds = max(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"{name:<22}{added / GIB:>16.3f}{added / base_mem:>8.2f}{seconds:>17.3f}{seconds / base_time:>8.2f}")


if __name__ == "__main__":
    main()
