"""The MiniGPT4Qwen instruction format, and the dataset every format is served by.

Annotation file: a JSON list of records
``{"image": "x.jpg", "instruction": "<Img><ImageHere></Img> question", "output": "answer"}``;
multi-turn records hold equal-length lists in ``instruction`` and ``output``.
Records are loaded and checked by :mod:`lavis_ds.datasets.loading` (structure and
image existence, at load time); whether an image decodes is found out when a
sample is loaded, and reported with the image file and the record.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from PIL import Image
from torch.utils.data import Dataset

from lavis_ds.common.errors import InputError
from lavis_ds.datasets.loading import RecordLoader
from lavis_ds.datasets.record_store import RecordStore
from lavis_ds.datasets.records import IMAGE_PLACEHOLDER, BadRecord, InstructionRecord, record_where

__all__ = ["IMAGE_PLACEHOLDER", "InstructionRecord", "InstructionDataset", "UnreadableImageError",
           "parse_record", "parse_instruction_file", "process_text"]

logger = logging.getLogger(__name__)

TextProcessor = Callable[[str], str]
VisProcessor = Callable[[Image.Image], torch.Tensor]

# A run of this many unreadable images in a row is not bad luck but a wrong image root.
MAX_CONSECUTIVE_REPLACEMENTS = 50


class UnreadableImageError(InputError, OSError):
    """An image file that does not decode; the message names the file and the record.

    An :class:`InputError`: raised inside a DataLoader worker, it still ends the run as
    one message naming the image (train.py strips the worker's traceback from it).
    """


class MissingImageError(InputError, FileNotFoundError):
    """An image file that went missing after the annotation files were checked."""


def _turns(record: dict, key: str, where: str) -> tuple[str, ...]:
    value = record[key]
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        if not value:
            raise BadRecord(where, f"{key!r} is an empty list")
        for turn, text in enumerate(value):
            if not isinstance(text, str):
                raise BadRecord(where, f"{key!r}[{turn}] must be a string, got {type(text).__name__}: {text!r}")
        return tuple(value)
    raise BadRecord(where, f"{key!r} must be a string or a list of strings, got {type(value).__name__}: {value!r}")


def parse_record(raw: Any, source: Path, position: int) -> InstructionRecord:
    """Validate one MiniGPT4Qwen record; raise :class:`BadRecord` naming file, index and problem."""
    where = record_where(source, position)
    if not isinstance(raw, dict):
        raise BadRecord(where, f"expected an object with keys image, instruction, output; got {type(raw).__name__}")
    missing = [key for key in ("image", "instruction", "output") if key not in raw]
    if missing:
        raise BadRecord(where, f"missing key(s) {', '.join(map(repr, missing))} (record has {sorted(raw)})")
    image = raw["image"]
    if not isinstance(image, str) or not image:
        raise BadRecord(where, f"'image' must be a non-empty string (a path under the image root), got {image!r}")
    where = record_where(source, position, image=image)
    instructions = _turns(raw, "instruction", where)
    outputs = _turns(raw, "output", where)
    if isinstance(raw["instruction"], list) != isinstance(raw["output"], list) or len(instructions) != len(outputs):
        raise BadRecord(
            where, f"'instruction' and 'output' must both be strings or both lists of the same length "
                   f"(one output per turn); got {len(instructions)} instruction(s) and {len(outputs)} output(s)")
    return InstructionRecord(image, instructions, outputs, source, position)


def parse_instruction_file(raw: Any, source: Path) -> Iterator[InstructionRecord | BadRecord]:
    """The MiniGPT4Qwen format (see the module docstring) as a :data:`~lavis_ds.datasets.loading.ParseFile`."""
    if not isinstance(raw, list):
        raise ValueError(f"{source}: expected a JSON list of records, got a {type(raw).__name__}")
    for position, item in enumerate(raw):
        try:
            yield parse_record(item, source, position)
        except BadRecord as bad:
            yield bad


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
    """Images + instruction/output turns, from annotation files of any supported format.

    Args:
        annotation_paths: one or more JSON annotation files, concatenated in order.
        image_root: folder that the records' ``image`` paths are relative to.
        vis_processor: PIL image -> FloatTensor [3, H, W].
        text_processor: applied to every instruction and output string (not to the
            image placeholder); ``None`` keeps the text as written.
        loader: reads the files (format and bad-record policy); default: MiniGPT4Qwen
            instruction JSON, every bad record an error, image files checked to exist.
        replace_unreadable_images: a sample whose image is missing or does not decode
            is replaced by the next record whose image loads (deterministic), and the
            replacement is logged and counted in :attr:`replaced_images`; otherwise
            loading that sample raises an error naming the image file and the record.
    """

    def __init__(
        self,
        annotation_paths: str | os.PathLike | Sequence[str | os.PathLike],
        image_root: str | os.PathLike,
        vis_processor: VisProcessor,
        text_processor: TextProcessor | None = None,
        *,
        loader: RecordLoader | None = None,
        replace_unreadable_images: bool = False,
    ) -> None:
        if isinstance(annotation_paths, (str, os.PathLike)):
            annotation_paths = [annotation_paths]
        if not annotation_paths:
            raise ValueError("InstructionDataset needs at least one annotation file")
        self.image_root = Path(image_root)
        self.vis_processor = vis_processor
        self.text_processor = text_processor
        loader = loader or RecordLoader(parse_instruction_file)
        loaded = loader.load([Path(p) for p in annotation_paths], self.image_root)
        # Packed, decoded per access: DataLoader workers share it instead of copying it (see record_store).
        self.records: RecordStore = loaded.records
        self.skipped: list[BadRecord] = loaded.skipped  # left out at load time (skip policy of `loader`)
        self.skip_summary = loaded.skip_summary()
        self.replace_unreadable_images = replace_unreadable_images
        self.replaced_images = 0  # per process: each DataLoader worker counts its own

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """The sample at ``index`` (``"index"`` is the record actually used, after any replacement)."""
        index, image = self._image_or_replacement(index)
        record = self.records[index]
        return {
            "image": self.vis_processor(image),
            "instruction": [self._text(t) for t in record.instructions],
            "output": [self._text(t) for t in record.outputs],
            # What evaluation scores the generated answer against (raw: metrics normalise for themselves).
            "references": list(record.references or record.outputs[-1:]),
            "index": index,
        }

    def image_name(self, index: int) -> str:
        """The record's image path as the annotation file gives it (for reports)."""
        return self.records[index].image

    def _text(self, text: str) -> str:
        return text if self.text_processor is None else process_text(text, self.text_processor)

    def _image_or_replacement(self, index: int) -> tuple[int, Image.Image]:
        if not self.replace_unreadable_images:
            return index, self._load_image(self.records[index])
        first_error = None
        for step in range(min(MAX_CONSECUTIVE_REPLACEMENTS, len(self.records))):
            candidate = (index + step) % len(self.records)
            try:
                image = self._load_image(self.records[candidate])
            except OSError as e:
                first_error = first_error or e
                continue
            if step:
                self._count_replacement(first_error, index, candidate)
            return candidate, image
        raise UnreadableImageError(f"{first_error}; the images of the next {MAX_CONSECUTIVE_REPLACEMENTS - 1} records are "
                      f"unreadable too, so no replacement was found: is the image root {self.image_root} right?")

    def _count_replacement(self, error: OSError, index: int, replacement: int) -> None:
        self.replaced_images += 1
        n = self.replaced_images
        if n <= 5 or n % 100 == 0:  # the first few, then every hundredth: a log, not a flood
            logger.warning("%s; sample %d replaced by record %d (%d unreadable image(s) replaced so far "
                           "in this process)", error, index, replacement, n)

    def _load_image(self, record: InstructionRecord) -> Image.Image:
        path = self.image_root / record.image
        if not path.is_file():
            raise MissingImageError(f"{record.where()}: image file {path} not found (image root {self.image_root})")
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
            raise UnreadableImageError(f"{record.where()}: cannot read image file {path}: "
                                       f"{type(e).__name__}: {e}") from e

    @staticmethod
    def collater(samples: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """Stack images; keep turns as lists of lists (one inner list per sample)."""
        samples = list(samples)
        return {
            "image": torch.stack([s["image"] for s in samples]),
            "instruction": [list(s["instruction"]) for s in samples],
            "output": [list(s["output"]) for s in samples],
            "references": [list(s["references"]) for s in samples],
            "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        }
