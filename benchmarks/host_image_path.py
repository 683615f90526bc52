"""The Qwen-VL image path on the host, in samples/s per core, on a LLaVA-665k-like mix: each stage, then the loader.

    python benchmarks/host_image_path.py [--records 1024] [--workers 0,1,2] [--micro 2] [--arch qwen2_vl]

Data: a ``llava_conversation`` file of ``--records`` records in the proportions of llava_v1_5_mix665k.json's parts
(``benchmarks/llava_mix.py``'s ``PARTS``: 6.2 % text-only ShareGPT conversations, the rest one image each, 1-20
question/answer pairs), their images JPEGs (quality 90, smooth colour fields with sensor-like noise, so that they
compress and decode like photographs; ``--images-per-folder`` distinct files per folder, cycled) written into a
temporary folder at the sizes of the mix's image sources (``SOURCE_SIZES``: COCO's 640x480 and its other shapes,
Visual Genome's 800x600 and 500x375 for GQA and VG, OCR-VQA's tall book covers, TextVQA's 1024-wide OpenImages).

Everything measured is lavis_ds's own code, as a ``run.batch_unit: tokens`` training run of ``--arch``'s tiny preset
runs it (``--micro`` rows of ``--max-len`` tokens, packed): the dataset (``InstructionDataset`` from the
``llava_conversation`` builder with the tower's ``qwen_vl_image`` processor), its collater, the model's host
preparation (``Objective.prepare``: tokenizing, the placeholders, M-RoPE positions, packing into rows) and the
token budget's plan (``datasets.lengths.token_length_of`` reading each image's size from its file header, and
``TokenBudgetSampler`` cutting the epoch into micro-batches), and the trainer's DataLoader
(``runners.data.make_loader``).

One process with one torch thread (one core), in one run:
1. **Stages**, each over the same samples in turn, repeated ``--repeats`` times (the best of them: the least
   disturbed by other load): JPEG decode (``PIL`` open and RGB convert, as the dataset's ``_load_image``),
   ``smart_resize`` + bicubic resize + normalise (``QwenVLProcessing._resized``), patchify (``_patchify``), the
   whole ``dataset[i]`` (the three and the record's text), the collater, ``Objective.prepare`` per micro-batch, and
   the token budget's plan per sample (each record's estimate from its images' header sizes, the rows filled; its
   fit on up to 256 samples' exact counts, once per run, is printed apart).
2. **Loader**: samples/s of the DataLoader over the token budget's micro-batches with each of ``--workers`` worker
   counts, the main process preparing every micro-batch as the trainer does (``TrainData.prepare``), and the
   ratio to 0 workers (everything in the one process), measured back to back.

From the measured tokens per sample (text and image tokens, as prepared) and the per-core rate it prints how many
loader workers keep one GPU fed at ``--tokens-per-s`` LLM tokens/s. Nothing is asserted; figures go to
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "benchmarks"))

# (width, height) px of each image source of the LLaVA-665k mix and the share of its images at that size: the typical
# sizes of those collections (COCO train2017's 640-px long side; Visual Genome, which GQA draws from, mostly 800x600
# and 500x375; OCR-VQA's Amazon book covers, tall; TextVQA's OpenImages at 1024 px wide), not measured from the files.
SOURCE_SIZES = {
    "coco/train2017": [((640, 480), 0.45), ((640, 427), 0.25), ((480, 640), 0.15), ((640, 360), 0.05),
                       ((612, 612), 0.05), ((500, 375), 0.05)],
    "gqa/images": [((800, 600), 0.45), ((500, 375), 0.2), ((800, 533), 0.15), ((600, 800), 0.1), ((500, 333), 0.1)],
    "ocr_vqa/images": [((333, 500), 0.4), ((300, 475), 0.3), ((500, 750), 0.2), ((400, 400), 0.1)],
    "textvqa/train_images": [((1024, 768), 0.5), ((1024, 683), 0.2), ((768, 1024), 0.15), ((1024, 576), 0.15)],
    "vg/VG_100K": [((800, 600), 0.45), ((500, 375), 0.2), ((800, 533), 0.15), ((600, 800), 0.1), ((500, 333), 0.1)],
    "vg/VG_100K_2": [((800, 600), 0.45), ((500, 375), 0.2), ((800, 533), 0.15), ((600, 800), 0.1),
                     ((500, 333), 0.1)],
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1024, help="records of the annotation file")
    parser.add_argument("--images-per-folder", type=int, default=16, help="distinct JPEGs per image folder")
    parser.add_argument("--arch", default="qwen2_vl", help="the architecture whose tiny preset's tower processes")
    parser.add_argument("--micro", type=int, default=2, help="rows per micro-batch (run.batch_size_train)")
    parser.add_argument("--max-image-tokens", type=int, default=1280,
                        help="max_pixels in LLM tokens (Qwen2-VL's published 28*28*1280 px: 1280)")
    parser.add_argument("--max-len", type=int, default=4096, help="run.max_seq_len and model.max_txt_len")
    parser.add_argument("--workers", default="0,1,2", help="DataLoader worker counts to measure")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the samples per stage (the best is kept)")
    parser.add_argument("--stage-samples", type=int, default=96, help="samples each stage is timed on")
    parser.add_argument("--loader-batches", type=int, default=24, help="micro-batches per worker count")
    parser.add_argument("--tokens-per-s", type=float, default=8000, help="LLM tokens/s one GPU trains on")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- the data
def write_jpeg(path: Path, width: int, height: int, rng) -> None:
    """A photograph-like JPEG: a smooth colour field upsampled, with noise (compresses to ~100 KB at 640x480)."""
    import numpy as np
    from PIL import Image

    field = rng.random((6, 8, 3)) * 255
    smooth = np.asarray(Image.fromarray(field.astype(np.uint8)).resize((width, height), Image.BICUBIC), np.float32)
    pixels = np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, quality=90)


def write_data(folder: Path, records: int, per_folder: int, seed: int) -> tuple[Path, Path, Path]:
    """``(annotation file, image root, tokenizer folder)`` of a LLaVA-665k-like mix under ``folder``."""
    import numpy as np

    from llava_mix import PARTS, _corpus, _record
    from lavis_ds.models.hf.qwen_vl import VISION_TOKENS
    from lavis_ds.models.tokenizer import SPECIAL_TOKENS, train_chatml_tokenizer

    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    root = folder / "images"
    names: dict[str, list[str]] = {}
    for source, sizes in SOURCE_SIZES.items():
        shapes = rng.choices([s for s, _ in sizes], [w for _, w in sizes], k=per_folder)
        names[source] = []
        for k, (width, height) in enumerate(shapes):
            name = f"{source}/{k:06d}.jpg"
            write_jpeg(root / name, width, height, np_rng)
            names[source].append(name)
    corpus = _corpus(rng)
    items = []
    for n, part in enumerate(rng.choices(PARTS, [p.records for p in PARTS], k=records)):
        record = _record(rng, corpus, part, n, 0)
        if part.folder is not None:
            record["image"] = names[part.folder][n % per_folder]
        items.append(record)
    annotation = folder / "llava.json"
    annotation.write_text(json.dumps(items))
    texts = [turn["value"] for record in items for turn in record["conversations"]]
    # A byte-level BPE of 8k tokens on the records' text (about as many tokens per word as a real LLM tokenizer
    # gives English), with Qwen-VL's vision tokens as single tokens, as Qwen's tokenizer has them.
    special = (*SPECIAL_TOKENS, *(t for t in (*VISION_TOKENS, "<|video_pad|>") if t not in SPECIAL_TOKENS))
    tokenizer = train_chatml_tokenizer(texts, folder / "tokenizer", vocab_size=8192, special_tokens=special)
    return annotation, root, tokenizer


# ----------------------------------------------------------------------------- what is measured
def build(args, annotation: Path, root: Path, tokenizer: Path):
    """The tiny model of ``--arch`` (its host side: tokenizer, placeholders, positions), its objective, and the
    training set as the ``llava_conversation`` builder makes it with the tower's ``qwen_vl_image`` processor."""
    importlib.import_module("lavis_ds")  # fills the registries
    from lavis_ds.common.registry import registry
    from lavis_ds.common.seeding import SeededDataset
    from lavis_ds.datasets import LlavaConversationBuilder
    from lavis_ds.objectives import build_objective

    cls = registry.get_model_class(args.arch)
    section = cls.default_config("tiny")
    factor = 28 if args.arch in ("qwen2_vl", "qwen2_5_vl") else 32  # a merged token's side: 2 x 14 or 2 x 16 px
    # Qwen's published pixel bounds (the tiny preset keeps images small): 4 to --max-image-tokens tokens an image
    tower = {**section["vision_tower"], "min_pixels": 4 * factor * factor,
             "max_pixels": args.max_image_tokens * factor * factor}
    model = cls.from_config({**section, "vision_tower": tower, "tokenizer": str(tokenizer),
                             "max_txt_len": args.max_len})
    processor = {"name": "qwen_vl_image", **model.vision_tower.processing.processor_keys()}
    data = {"builder": "llava_conversation",
               "build_info": {"annotations": {"train": {"storage": str(annotation)}}, "images": {"storage": str(root)}},
               "vis_processor": {"train": processor, "eval": processor}}
    dataset = LlavaConversationBuilder(data).build()["train"]
    return model, build_objective({}), SeededDataset(dataset, args.seed)


def best_rate(samples: int, repeats: int, work) -> float:
    """Samples/s of the fastest of ``repeats`` passes of ``work()`` (one pass handles ``samples`` samples)."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return samples / best


def stage_rates(args, model, objective, train_set) -> tuple[dict[str, float], list[dict], float, float]:
    """Samples/s of each stage on one core, the collater stage's micro-batches prepared, images per sample, and the
    seconds of the token budget's fit."""
    from lavis_ds.datasets.lengths import counted_by, token_length_of
    from lavis_ds.datasets.samplers import TokenBudgetSampler
    from lavis_ds.processors.qwen_vl import _uint8_chw

    dataset = train_set.dataset
    indices = list(range(min(args.stage_samples, len(dataset))))
    records = [dataset.records[i] for i in indices]
    images = [(r, name) for r in records for name in r.images]
    per_image = len(images) / len(indices)  # a text-only record has none: stages of one image count per sample
    processing = dataset.vis_processor.processing
    decoded = [dataset._load_image(r, name) for r, name in images]
    arrays = [_uint8_chw(image)[None] for image in decoded]
    resized = [processing._resized(a) for a in arrays]
    frames = [r[:, None].expand(-1, processing.temporal_patch_size, -1, -1, -1) for r in resized]
    samples = [train_set[i] for i in indices]
    micro = [samples[k:k + 16] for k in range(0, len(samples), 16)]
    collated = [dataset.collater(m) for m in micro]
    rates = {
        "JPEG decode (PIL open, RGB)": best_rate(len(images), args.repeats, lambda: [
            dataset._load_image(r, name) for r, name in images]) / per_image,
        "smart_resize + resize + normalise": best_rate(len(images), args.repeats, lambda: [
            processing._resized(a) for a in arrays]) / per_image,
        "patchify": best_rate(len(images), args.repeats, lambda: [processing._patchify(f) for f in frames]) / per_image,
        "dataset[i] (all of the above + text)": best_rate(len(indices), args.repeats, lambda: [
            train_set[i] for i in indices]),
        "collate (16 a batch)": best_rate(len(indices), args.repeats, lambda: [dataset.collater(m) for m in micro]),
        "prepare: tokens, M-RoPE, packing": best_rate(len(indices), args.repeats, lambda: [
            objective.prepare(model, batch, args.max_len) for batch in collated]),
    }

    # The token budget: a fit on up to 256 samples' exact counts (once per run, whatever the data's size), then each
    # record's estimate (its images' header sizes) and the rows filled, per sample and epoch.
    fits, plans = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        length_of = token_length_of(train_set, counted_by(model.prepare_batch), args.max_len,
                                    model.image_path.layout.tokens_for_image)
        fits.append(time.perf_counter() - start)
        start = time.perf_counter()
        TokenBudgetSampler(len(train_set), args.micro, args.max_len, 1, 1, 0, args.seed, length_of, 1)
        plans.append(time.perf_counter() - start)
    rates["token budget plan (header sizes, fill rows)"] = len(train_set) / min(plans)
    prepared = [objective.prepare(model, batch, None) for batch in collated]
    return rates, prepared, per_image, min(fits)


def tokens_per_sample(prepared: list[dict]) -> tuple[float, float]:
    """Mean LLM tokens per sample (text and image placeholders, as prepared, unpacked) and the image tokens' share."""
    tokens = sum(int(b["attention_mask"].sum()) for b in prepared)
    samples = sum(len(b["num_images"]) for b in prepared)
    image = sum(sum(b["image_tokens"]) for b in prepared) if all("image_tokens" in b for b in prepared) else 0
    return tokens / samples, image / tokens


def loader_rate(args, model, objective, train_set, workers: int, sampler) -> tuple[float, float, float]:
    """(seconds to the first micro-batch, samples/s and LLM tokens/s over the next ``--loader-batches``) of the
    trainer's DataLoader with ``workers`` workers, each micro-batch prepared (packed) in this process as the trainer
    prepares it."""
    from lavis_ds.runners.data import make_loader

    start = time.perf_counter()
    iterator = iter(make_loader(train_set, sampler, SimpleNamespace(num_workers=workers)))
    objective.prepare(model, next(iterator), args.max_len)
    first_s = time.perf_counter() - start
    start, samples, tokens = time.perf_counter(), 0, 0
    for _ in range(args.loader_batches):
        batch = next(iterator)
        samples += len(batch["index"])
        tokens += int(objective.prepare(model, batch, args.max_len)["attention_mask"].sum())
    seconds = time.perf_counter() - start
    del iterator  # ends the workers
    return first_s, samples / seconds, tokens / seconds


def report_stages(args, rates: dict[str, float], per_image: float, per_sample: float, image_share: float,
                  samples: int, fit_s: float) -> None:
    print(f"\nQwen-VL image path on the host ({args.arch}'s tower processing), one process, one thread; {samples} "
          f"LLaVA-665k-like records, {per_image:.2f} images a sample; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"{'stage':<46}{'samples/s/core':>15}{'ms/sample':>11}")
    for stage, rate in rates.items():
        print(f"{stage:<46}{rate:>15.1f}{1000 / rate:>11.2f}")
    print(f"token budget fit (exact counts of up to 256 samples, once per run): {fit_s:.2f} s")
    print(f"tokens per sample (text + image, as prepared): {per_sample:.0f}, image tokens {image_share:.0%}")


def report_loader(args, model, objective, train_set) -> None:
    """The trainer's DataLoader with each worker count, back to back, against 0 workers."""
    from lavis_ds.datasets.lengths import counted_by, token_length_of
    from lavis_ds.datasets.samplers import TokenBudgetSampler

    length_of = token_length_of(train_set, counted_by(model.prepare_batch), args.max_len,
                                model.image_path.layout.tokens_for_image)
    sampler = TokenBudgetSampler(len(train_set), args.micro, args.max_len, 1, 1, 0, args.seed, length_of, 1)
    print(f"\nthe trainer's DataLoader: micro-batches of {args.micro} rows of {args.max_len} tokens (token budget), "
          f"each prepared (packed) in the main process; {args.loader_batches} micro-batches per setting")
    print(f"{'workers':>8}{'first batch s':>15}{'samples/s':>11}{'LLM tokens/s':>14}{'x 0 workers':>13}{'load':>6}")
    base = None
    for workers in (int(w) for w in args.workers.split(",")):
        first_s, rate, tokens_per_s = loader_rate(args, model, objective, train_set, workers, sampler)
        base = base or rate
        print(f"{workers:>8}{first_s:>15.2f}{rate:>11.1f}{tokens_per_s:>14.0f}{rate / base:>13.2f}"
              f"{os.getloadavg()[0]:>6.1f}", flush=True)


def report_workers_needed(args, rates: dict[str, float], per_sample: float) -> None:
    """Loader workers (one core each) that make the samples one GPU trains on at ``--tokens-per-s``; the main
    process collates nothing (the workers do) and prepares every micro-batch."""
    item = rates["dataset[i] (all of the above + text)"]
    worker = 1 / (1 / item + 1 / rates["collate (16 a batch)"])
    need = args.tokens_per_s / per_sample
    print(f"\none GPU at {args.tokens_per_s:,.0f} LLM tokens/s takes {need:.1f} samples/s; one worker core reads, "
          f"processes and collates {worker:.1f} samples/s -> {math.ceil(need / worker)} worker(s) at full use "
          f"({need / worker:.2f} of a core); the main process prepares them in "
          f"{need / rates['prepare: tokens, M-RoPE, packing']:.0%} of a core")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: the rates are per core (DataLoader workers take one thread each anyway)
    try:
        with tempfile.TemporaryDirectory(prefix="host_image_path_") as tmp:
            annotation, root, tokenizer = write_data(Path(tmp), args.records, args.images_per_folder, args.seed)
            model, objective, train_set = build(args, annotation, root, tokenizer)
            rates, prepared, per_image, fit_s = stage_rates(args, model, objective, train_set)
            per_sample, image_share = tokens_per_sample(prepared)
            report_stages(args, rates, per_image, per_sample, image_share, len(train_set), fit_s)
            report_loader(args, model, objective, train_set)
            report_workers_needed(args, rates, per_sample)
    finally:
        torch.set_num_threads(threads)  # the caller's again (the suite's smoke run calls main in its own process)


if __name__ == "__main__":
    main()
