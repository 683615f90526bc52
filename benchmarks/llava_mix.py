"""A synthetic LLaVA-1.5 instruction mix (llava_v1_5_mix665k.json's record shapes) with tiny images.

    python benchmarks/llava_mix.py --out /tmp/llava_mix [--records 665000]

The annotation file is what ``llava_conversation`` reads; its records follow the parts of the
real mix (LLaVA-1.5 paper, Table 7: LLaVA-Instruct 158k, ShareGPT 40k, VQAv2 83k, GQA 72k,
OKVQA 9k, OCRVQA 80k, A-OKVQA 66k, TextCaps 22k, RefCOCO 48k, VG 86k): the same six image
folders (``coco/train2017``, ``gqa/images``, ``ocr_vqa/images``, ``textvqa/train_images``,
``vg/VG_100K``, ``vg/VG_100K_2``), 1 to 20 question/answer pairs per record (VQA-style
parts group several questions about one image), the short-answer prompt of the VQA parts,
long answers for LLaVA's detail and reasoning parts, and ShareGPT's text-only
conversations (no ``image`` key). Texts are random words; a record is about 1 KB of JSON.

Images: every image path of the file exists, as a hard link to a tiny JPEG (16x16, 600
bytes; one file per 50,000 names, as ext4 allows 65,000 links to a file): the folders hold as many names as the real mix's folders hold images
(scaled with ``--records``), at no disk cost. Only loading and indexing are realistic here,
not image decoding (``benchmarks/loader_throughput.py`` measures that on real-size images).
"""
from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

REAL_RECORDS = 665_298  # llava_v1_5_mix665k.json
VQA_PROMPT = "\nAnswer the question using a single word or phrase."


@dataclass(frozen=True)
class Part:
    """One source of the mix: how many records, which folder, how many pairs, how long the texts."""

    name: str
    records: int  # in the real mix
    folder: str | None  # None: text-only
    images: int  # distinct images in the folder (real mix)
    max_pairs: int
    mean_pairs: float
    question: int  # characters
    answer: int
    prompt: str = ""


PARTS = (
    Part("llava_conversation", 58_000, "coco/train2017", 118_000, 10, 3.0, 60, 220),
    Part("llava_detail", 23_000, "coco/train2017", 118_000, 1, 1, 50, 600),
    Part("llava_reasoning", 77_000, "coco/train2017", 118_000, 1, 1, 100, 650),
    Part("vqav2", 83_000, "coco/train2017", 118_000, 20, 5.0, 40, 6, VQA_PROMPT),
    Part("okvqa", 9_000, "coco/train2017", 118_000, 1, 1, 50, 8, VQA_PROMPT),
    Part("aokvqa", 66_000, "coco/train2017", 118_000, 1, 1, 160, 3),
    Part("refcoco", 48_000, "coco/train2017", 118_000, 20, 4.0, 70, 24),
    Part("gqa", 72_000, "gqa/images", 72_000, 20, 9.0, 45, 6, VQA_PROMPT),
    Part("ocrvqa", 80_000, "ocr_vqa/images", 80_000, 20, 5.0, 35, 14, VQA_PROMPT),
    Part("textcaps", 22_000, "textvqa/train_images", 22_000, 1, 1, 60, 70),
    Part("vg", 43_000, "vg/VG_100K", 43_000, 20, 4.0, 60, 24),
    Part("vg_2", 43_000, "vg/VG_100K_2", 43_000, 20, 4.0, 60, 24),
    Part("sharegpt", 41_000, None, 0, 20, 2.5, 250, 900),
)


def _corpus(rng: random.Random) -> str:
    """2 MB of random words (some not ASCII) to cut texts from."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)] + ["naïve", "café", "日本"]
    return " ".join(rng.choices(words, k=330_000))


def _text(rng: random.Random, corpus: str, mean: int) -> str:
    length = max(1, int(rng.uniform(0.4, 1.6) * mean))
    start = rng.randrange(len(corpus) - length)
    return corpus[start:start + length].strip() or "x"


def _pairs(rng: random.Random, part: Part) -> int:
    if part.max_pairs == 1:
        return 1
    return min(part.max_pairs, 1 + int(rng.expovariate(1 / (part.mean_pairs - 1))))


def _image_name(part: Part, number: int) -> str:
    if part.folder == "coco/train2017":
        return f"{part.folder}/{number:012d}.jpg"
    return f"{part.folder}/{number + 1000000}.jpg"


def _record(rng: random.Random, corpus: str, part: Part, number: int, image_number: int) -> dict:
    turns = []
    for pair in range(_pairs(rng, part)):
        question = _text(rng, corpus, part.question) + "?" + part.prompt
        if pair == 0 and part.folder is not None:
            question = f"<image>\n{question}" if rng.random() < 0.9 else f"{question}\n<image>"
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": _text(rng, corpus, part.answer)}]
    record = {"id": f"{part.name}_{number}", "conversations": turns}
    if part.folder is not None:
        record = {"id": record["id"], "image": _image_name(part, image_number), "conversations": turns}
    return record


LINKS_PER_FILE = 50_000  # ext4 allows 65,000 hard links to one file


def _tiny_jpeg(folder: Path, k: int) -> Path:
    """The ``k``-th tiny JPEG (16x16, one of four colours), written on first use."""
    path = folder / f"tiny_{k}.jpg"
    if not path.exists():
        from PIL import Image

        folder.mkdir(parents=True, exist_ok=True)
        colour = ((200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30))[k % 4]
        Image.new("RGB", (16, 16), colour).save(path, quality=90)
    return path


def write_llava_mix(out: Path, records: int = REAL_RECORDS, seed: int = 0) -> tuple[Path, Path]:
    """``(annotation file, image root)`` of a mix of ``records`` records; reused if already written alike."""
    out = Path(out)
    annotation, images, done = out / "llava_mix.json", out / "images", out / "DONE"
    spec = {"records": records, "seed": seed, "version": 1}
    if done.is_file() and json.loads(done.read_text())["spec"] == spec:
        return annotation, images
    rng = random.Random(seed)
    corpus = _corpus(rng)
    scale = records / REAL_RECORDS
    counts = [round(p.records * scale) for p in PARTS]
    counts[0] += records - sum(counts)
    plan = [(part, n) for part, count in zip(PARTS, counts) for n in range(count)]
    rng.shuffle(plan)  # the real file is a shuffled mix too

    linked: dict[str, set[int]] = {}
    links = 0
    images.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    with annotation.open("w", encoding="utf-8") as f:
        f.write("[\n")
        for i, (part, n) in enumerate(plan):
            image_number = rng.randrange(max(1, round(part.images * scale)))
            record = _record(rng, corpus, part, n, image_number)
            if part.folder is not None:
                seen = linked.setdefault(part.folder, set())
                if image_number not in seen:
                    seen.add(image_number)
                    target = images / record["image"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if not target.exists():
                        os.link(_tiny_jpeg(out / "tiny_jpegs", links // LINKS_PER_FILE), target)
                    links += 1
            f.write(("," if i else "") + json.dumps(record, ensure_ascii=False) + "\n")
        f.write("]\n")
    done.write_text(json.dumps({"spec": spec, "summary": _summary(annotation)}))
    return annotation, images


def _summary(annotation: Path) -> str:
    """Counts that show the file has the mix's shapes."""
    raw = json.loads(annotation.read_text(encoding="utf-8"))
    pairs = [len(r["conversations"]) // 2 for r in raw]
    folders = {}
    for r in raw:
        folder = r["image"].rsplit("/", 1)[0] if "image" in r else "(text-only)"
        folders[folder] = folders.get(folder, 0) + 1
    size = annotation.stat().st_size
    return (f"{annotation}: {len(raw)} records, {size / 2**20:.0f} MiB ({size / len(raw):.0f} bytes/record), "
            f"{min(pairs)}-{max(pairs)} question/answer pairs (mean {sum(pairs) / len(pairs):.1f}); "
            + ", ".join(f"{k} {v}" for k, v in sorted(folders.items())))


def describe(annotation: Path) -> str:
    """The summary written beside the file when it was generated."""
    return json.loads((annotation.parent / "DONE").read_text())["summary"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--records", type=int, default=REAL_RECORDS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(describe(write_llava_mix(args.out, args.records, args.seed)[0]))


if __name__ == "__main__":
    main()
