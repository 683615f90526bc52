"""The MiniGPT4Qwen instruction format: image + (multi-turn) instruction/output.

Annotation file: a JSON list of records
``{"image": "x.jpg", "instruction": "<Img><ImageHere></Img> question", "output": "answer"}``;
multi-turn records hold equal-length lists in ``instruction`` and ``output``.
Every record is checked when the files are loaded, so a malformed one is
reported with its file and position before training starts, not inside a
DataLoader worker hours later.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from PIL import Image
from torch.utils.data import Dataset

# Where the model splices in the projected query embeddings; text processors
# must never see it (blip_caption would lowercase it into something unrecognisable).
IMAGE_PLACEHOLDER = "<Img><ImageHere></Img>"

TextProcessor = Callable[[str], str]
VisProcessor = Callable[[Image.Image], torch.Tensor]


@dataclass(frozen=True)
class InstructionRecord:
    """One validated annotation record; turns are always tuples (length 1 for single turn)."""

    image: str
    instructions: tuple[str, ...]
    outputs: tuple[str, ...]
    source: Path  # annotation file, for error messages
    position: int  # index of the record inside ``source``

    def where(self) -> str:
        return f"{self.source}: record {self.position} (image {self.image!r})"


def _turns(record: dict, key: str, where: str) -> tuple[str, ...]:
    value = record[key]
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{where}: {key!r} is an empty list")
        for turn, text in enumerate(value):
            if not isinstance(text, str):
                raise ValueError(f"{where}: {key!r}[{turn}] must be a string, got {type(text).__name__}: {text!r}")
        return tuple(value)
    raise ValueError(f"{where}: {key!r} must be a string or a list of strings, got {type(value).__name__}: {value!r}")


def parse_record(raw: Any, source: Path, position: int) -> InstructionRecord:
    """Validate one raw JSON record; raise ``ValueError`` naming file, index and problem."""
    where = f"{source}: record {position}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with keys image, instruction, output; got {type(raw).__name__}")
    missing = [key for key in ("image", "instruction", "output") if key not in raw]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(map(repr, missing))} (record has {sorted(raw)})")
    image = raw["image"]
    if not isinstance(image, str) or not image:
        raise ValueError(f"{where}: 'image' must be a non-empty string (a path under the image root), got {image!r}")
    instructions = _turns(raw, "instruction", where)
    outputs = _turns(raw, "output", where)
    if isinstance(raw["instruction"], list) != isinstance(raw["output"], list) or len(instructions) != len(outputs):
        raise ValueError(
            f"{where}: 'instruction' and 'output' must both be strings or both lists of the same length "
            f"(one output per turn); got {len(instructions)} instruction(s) and {len(outputs)} output(s)"
        )
    return InstructionRecord(image, instructions, outputs, source, position)


def load_annotation_file(path: str | os.PathLike) -> list[InstructionRecord]:
    """Read and validate every record of one annotation file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"annotation file {path} does not exist")
    try:
        with path.open(encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a JSON list of records, got a {type(raw).__name__}")
    return [parse_record(item, path, i) for i, item in enumerate(raw)]


def process_text(text: str, text_processor: TextProcessor) -> str:
    """Apply ``text_processor`` to the text around the image placeholder, keeping the placeholder intact."""
    pieces = []
    for i, part in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            pieces.append(IMAGE_PLACEHOLDER)
        if part.strip():
            pieces.append(text_processor(part))
    return " ".join(pieces)


class InstructionDataset(Dataset):
    """Images + instruction/output turns from MiniGPT4Qwen annotation files.

    Args:
        annotation_paths: one or more JSON annotation files, concatenated in order.
        image_root: folder that the records' ``image`` paths are relative to.
        vis_processor: PIL image -> FloatTensor [3, H, W].
        text_processor: applied to every instruction and output string (not to the
            image placeholder); ``None`` keeps the text as written.
    """

    def __init__(
        self,
        annotation_paths: str | os.PathLike | Sequence[str | os.PathLike],
        image_root: str | os.PathLike,
        vis_processor: VisProcessor,
        text_processor: TextProcessor | None = None,
    ) -> None:
        if isinstance(annotation_paths, (str, os.PathLike)):
            annotation_paths = [annotation_paths]
        if not annotation_paths:
            raise ValueError("InstructionDataset needs at least one annotation file")
        self.image_root = Path(image_root)
        self.vis_processor = vis_processor
        self.text_processor = text_processor
        self.records: list[InstructionRecord] = [
            record for path in annotation_paths for record in load_annotation_file(path)
        ]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.records[index]
        return {
            "image": self.vis_processor(self._load_image(record)),
            "instruction": [self._text(t) for t in record.instructions],
            "output": [self._text(t) for t in record.outputs],
            "index": index,
        }

    def image_name(self, index: int) -> str:
        """The record's image path as the annotation file gives it (for reports)."""
        return self.records[index].image

    def _text(self, text: str) -> str:
        return text if self.text_processor is None else process_text(text, self.text_processor)

    def _load_image(self, record: InstructionRecord) -> Image.Image:
        path = self.image_root / record.image
        if not path.is_file():
            raise FileNotFoundError(f"{record.where()}: image file {path} not found (image root {self.image_root})")
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except OSError as e:
            raise OSError(f"{record.where()}: cannot read image file {path}: {e}") from e

    @staticmethod
    def collater(samples: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """Stack images; keep turns as lists of lists (one inner list per sample)."""
        samples = list(samples)
        return {
            "image": torch.stack([s["image"] for s in samples]),
            "instruction": [list(s["instruction"]) for s in samples],
            "output": [list(s["output"]) for s in samples],
            "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        }
