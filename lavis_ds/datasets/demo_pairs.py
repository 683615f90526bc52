"""The demo's preference pairs: the demo shapes' questions, answered right (chosen) and with the wrong colour or
shape (rejected), written in LLaMA-Factory's sharegpt ranking format next to the demo data on first use.

    {storage}/pairs/{train,val}.json   (LLaMA-Factory ranking: conversations, chosen, rejected, images)

The ``demo_shape_pairs`` builder reads them with the ``preference_pairs`` parser, so the demo runs the same
code path as published preference data. Generation is deterministic (a seeded generator per split) and
atomic (a temporary file renamed into place).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from lavis_ds.common import registry as reg
from lavis_ds.datasets.demo_builder import DemoShapesBuilder
from lavis_ds.datasets.demo_shapes import COLOURS, SHAPES, ensure_demo_shapes
from lavis_ds.datasets.instruction import IMAGE_PLACEHOLDER
from lavis_ds.datasets.loading import ParseFile
from lavis_ds.datasets.preference import PairDataset, pair_parser

PAIR_SPLITS = ("train", "val")


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with its colour or its shape word replaced by another one (the demo's answers name both, or one)."""
    words = answer.split(" ")
    options = [i for i, w in enumerate(words) if w in COLOURS or w in SHAPES]
    i = rng.choice(options)
    pool = list(COLOURS) if words[i] in COLOURS else list(SHAPES)
    words[i] = rng.choice([w for w in pool if w != words[i]])
    if words[0] in ("a", "an") and len(words) > 1:  # "a orange star" -> "an orange star"
        words[0] = "an" if words[1][0] in "aeiou" else "a"
    return " ".join(words)


def pair_record(record: dict, rng: random.Random) -> dict:
    """A demo instruction record as a LLaMA-Factory ranking record: its last answer chosen, a wrong one rejected."""
    instructions = record["instruction"] if isinstance(record["instruction"], list) else [record["instruction"]]
    outputs = record["output"] if isinstance(record["output"], list) else [record["output"]]
    turns = []
    for question, answer in zip(instructions, outputs, strict=True):
        turns.append({"from": "human", "value": question.replace(IMAGE_PLACEHOLDER, "<image>")})
        turns.append({"from": "gpt", "value": answer})
    chosen = turns.pop()
    return {"conversations": turns, "chosen": chosen,
            "rejected": {"from": "gpt", "value": wrong_answer(chosen["value"], rng)}, "images": [record["image"]]}


def ensure_demo_pairs(storage: Path) -> None:
    """Write ``pairs/{split}.json`` from the demo annotations, unless they are there."""
    for split in PAIR_SPLITS:
        path = storage / "pairs" / f"{split}.json"
        if path.is_file():
            continue
        records = json.loads((storage / "annotations" / f"{split}.json").read_text(encoding="utf-8"))
        rng = random.Random(f"demo_shape_pairs/{split}")
        pairs = [pair_record(r, rng) for r in records]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(pairs, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)  # several processes may write it at once: each whole, the last rename wins


@reg.builders.register("demo_shape_pairs")
class DemoShapePairsBuilder(DemoShapesBuilder):
    """The demo's preference pairs (``train``, ``val``): right against wrong colour/shape answers."""

    dataset_cls = PairDataset
    SAMPLES = "pairs"

    def prepare(self) -> None:
        ensure_demo_shapes(self.storage, self.spec())
        ensure_demo_pairs(self.storage)

    def generates(self) -> list[Path]:
        """The demo's folder when its images or its pair files are still to be made (the build makes them)."""
        pending = super().generates()
        try:
            missing_pairs = any(not path.is_file() for paths in self.annotation_files().values() for path in paths)
        except ValueError:
            return pending  # reported by check()
        return pending or ([self.storage] if missing_pairs else [])

    def check(self) -> list[str]:
        """As the demo's; pair files not written yet are none of the section's problems (the build writes them)."""
        try:
            unwritten = [str(path) for paths in self.annotation_files().values() for path in paths
                         if not path.is_file()]
        except ValueError:
            unwritten = []
        return [problem for problem in super().check() if not any(path in problem for path in unwritten)]

    def parse_file(self) -> ParseFile:
        return pair_parser("sharegpt")

    def annotation_files(self, problems: list[str] | None = None) -> dict[str, list[Path]]:
        try:
            storage = self.storage
        except ValueError as e:
            if problems is not None:
                problems.append(str(e))
            return {}
        return {split: [storage / "pairs" / f"{split}.json"] for split in PAIR_SPLITS}
