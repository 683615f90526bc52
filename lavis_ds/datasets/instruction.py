"""The MiniGPT4Qwen instruction format, and the dataset every format is served by.

Annotation file: a JSON list of records
``{"image": "x.jpg", "instruction": "<Img><ImageHere></Img> question", "output": "answer"}``;
multi-turn records hold equal-length lists in ``instruction`` and ``output``. ``image``
may be a list (one ``<ImageHere>`` per image, in order: MPP-LLaVA's multi-image prompt is
``<Img><ImageHere><ImageHere></Img> question``) or absent (a text-only record); a record
may name a ``video`` instead (MPP-LLaVA's ``videochatgpt_100k`` records), whose one marker
becomes one per sampled frame.
Records are loaded and checked by :mod:`lavis_ds.datasets.loading` (structure, markers and
file existence, at load time); whether an image or video decodes is found out when a
sample is loaded, and reported with the file and the record.

A sample's ``image`` is a FloatTensor ``[n, 3, H, W]`` (n = its images or frames, 0 for
text-only) and ``num_images`` is n. The collater concatenates every sample's images into
one flat ``[sum n, 3, H, W]`` tensor and keeps the counts as a list: the model runs its
vision tower once on the flat tensor and scatters the outputs, in order, into the
placeholders (see ``VisionLLM.forward``).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from PIL import Image
from torch.utils.data import Dataset

from lavis_ds.common.errors import InputError
from lavis_ds.datasets.loading import RecordLoader
from lavis_ds.datasets.record_store import RecordStore
from lavis_ds.datasets.records import (IMAGE_HERE, IMAGE_PLACEHOLDER, BadRecord, InstructionRecord, count_markers,
                                       each_record, record_where)
from lavis_ds.datasets.video import UnreadableVideoError, read_frames, video_header
from lavis_ds.processors.qwen_vl import GRID_KEY, SECONDS_KEY

__all__ = ["IMAGE_PLACEHOLDER", "InstructionRecord", "InstructionDataset", "UnreadableImageError",
           "UnreadableVideoError", "parse_record", "parse_instruction_file", "process_text", "expand_video_marker"]

logger = logging.getLogger(__name__)

TextProcessor = Callable[[str], str]
VisProcessor = Callable[[Image.Image], torch.Tensor]

# A run of this many unreadable images in a row is not bad luck but a wrong image root.
MAX_CONSECUTIVE_REPLACEMENTS = 50
DEFAULT_MAX_FRAMES = 32  # MPP-LLaVA's videochatgpt_100k default (build_info.max_frames)
MAX_NOTES = 5  # per process, for notes about data that is used as it is (short videos): a log, not a flood
# An image marker group that text processors must not touch: <Img> with its markers, or a bare marker.
_MARKERS = re.compile(r"<Img>(?:<ImageHere>)+</Img>|<ImageHere>")


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


def _visuals(raw: dict, where: str) -> tuple[tuple[str, ...], str | None]:
    """``(images, video)`` of a record: ``image`` a path or a list of paths, or ``video`` a path, or neither."""
    if "image" in raw and "video" in raw:
        raise BadRecord(where, "has both 'image' and 'video'; a record holds images or one video")
    video = raw.get("video")
    if "video" in raw and (not isinstance(video, str) or not video):
        raise BadRecord(where, f"'video' must be a non-empty string (a path under the video root), got {video!r}")
    image = raw.get("image", [])
    images = [image] if isinstance(image, str) else image
    if (not isinstance(images, list) or ("image" in raw and not images)
            or not all(isinstance(i, str) and i for i in images)):
        raise BadRecord(where, f"'image' must be a non-empty string or a non-empty list of them (paths under the "
                               f"image root), got {image!r}")
    return tuple(images), video


def parse_record(raw: Any, source: Path, position: int) -> InstructionRecord:
    """Validate one MiniGPT4Qwen record; raise :class:`BadRecord` naming file, index and problem."""
    where = record_where(source, position)
    if not isinstance(raw, dict):
        raise BadRecord(where, f"expected an object with keys image, instruction, output; got {type(raw).__name__}")
    missing = [key for key in ("instruction", "output") if key not in raw]
    if missing:
        raise BadRecord(where, f"missing key(s) {', '.join(map(repr, missing))} (record has {sorted(raw)})")
    images, video = _visuals(raw, where)
    where = InstructionRecord(images, (), (), source, position, video=video).where()
    instructions = _turns(raw, "instruction", where)
    outputs = _turns(raw, "output", where)
    if isinstance(raw["instruction"], list) != isinstance(raw["output"], list) or len(instructions) != len(outputs):
        raise BadRecord(
            where, f"'instruction' and 'output' must both be strings or both lists of the same length "
                   f"(one output per turn); got {len(instructions)} instruction(s) and {len(outputs)} output(s)")
    return InstructionRecord(images, instructions, outputs, source, position, video=video)


def parse_instruction_file(raw: Any, source: Path) -> Iterator[InstructionRecord | BadRecord]:
    """The MiniGPT4Qwen format (see the module docstring) as a :data:`~lavis_ds.datasets.loading.ParseFile`."""
    yield from each_record(raw, source, "records", parse_record)


def process_text(text: str, text_processor: TextProcessor) -> str:
    """Apply ``text_processor`` to the text around the image markers, keeping each marker group intact
    (``<Img><ImageHere></Img>``, ``<Img><ImageHere><ImageHere></Img>``, a bare ``<ImageHere>``)."""
    pieces = []
    markers = _MARKERS.findall(text)
    for i, part in enumerate(_MARKERS.split(text)):
        if i:
            pieces.append(markers[i - 1])
        if part.strip():
            pieces.append(text_processor(part))
    return " ".join(pieces)


def visual_fields(vis_processor: Callable, visuals: list[Image.Image], video: bool) -> dict[str, Any]:
    """``image``: the processed images stacked; a processor of images at their own sizes (``sample_fields``,
    Qwen-VL's) gives flat patches with a grid row per image, and a video as one visual of its frames."""
    own_sizes = getattr(vis_processor, "sample_fields", None)
    if visuals and own_sizes is not None:
        # a video's frames carry the rate they sample it at (datasets.video.SampledFrames): its time spacing
        return own_sizes(visuals, video, getattr(visuals, "fps", None)) if video else own_sizes(visuals)
    if visuals:
        return {"image": torch.stack([vis_processor(v) for v in visuals])}
    size = getattr(vis_processor, "image_size", 0)  # an empty batch of the right shape, for the collater
    return {"image": torch.zeros((0, 3, size, size))}


def expand_video_marker(turns: list[str], num_frames: int) -> list[str]:
    """A video record's turns with its one marker repeated per frame (MPP-LLaVA: ``<Img>`` + ``<ImageHere>``
    x frames + ``</Img>``); without a marker the frames go in front of the first turn."""
    frames = IMAGE_HERE * num_frames
    if count_markers(turns) == 0:
        return [f"<Img>{frames}</Img> {turns[0]}", *turns[1:]]
    done = False
    expanded = []
    for turn in turns:
        if not done and IMAGE_HERE in turn:
            turn, done = turn.replace(IMAGE_HERE, frames, 1), True
        expanded.append(turn)
    return expanded


class InstructionDataset(Dataset):
    """Images (0..N per sample, or a video's frames) + instruction/output turns, from annotation files of any
    supported format.

    Args:
        annotation_paths: one or more JSON annotation files, concatenated in order.
        image_root: folder that the records' ``image`` and ``video`` paths are relative to.
        vis_processor: PIL image -> FloatTensor [3, H, W] (applied to every image and video frame).
        text_processor: applied to every instruction and output string (not to the
            image markers); ``None`` keeps the text as written.
        loader: reads the files (format and bad-record policy); default: MiniGPT4Qwen
            instruction JSON, every bad record an error, image files checked to exist.
        replace_unreadable_images: a sample whose image or video is missing or does not
            decode is replaced by the next record whose visual input loads (deterministic),
            and the replacement is logged and counted in :attr:`replaced_images`; otherwise
            loading that sample raises an error naming the file and the record.
        max_frames: frames sampled uniformly from a video record (fewer if the video has fewer).
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
        max_frames: int = DEFAULT_MAX_FRAMES,
    ) -> None:
        if isinstance(annotation_paths, (str, os.PathLike)):
            annotation_paths = [annotation_paths]
        if not annotation_paths:
            raise ValueError("InstructionDataset needs at least one annotation file")
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
            raise ValueError(f"max_frames must be a positive integer, got {max_frames!r}")
        self.image_root = Path(image_root)
        self.vis_processor = vis_processor
        self.text_processor = text_processor
        self.max_frames = max_frames
        loader = loader or RecordLoader(parse_instruction_file)
        loaded = loader.load([Path(p) for p in annotation_paths], self.image_root)
        # Packed, decoded per access: DataLoader workers share it instead of copying it (see record_store).
        self.records: RecordStore = loaded.records
        self.skipped: list[BadRecord] = loaded.skipped  # left out at load time (skip policy of `loader`)
        self.skip_summary = loaded.skip_summary()
        self.replace_unreadable_images = replace_unreadable_images
        self.replaced_images = 0  # per process: each DataLoader worker counts its own
        self.short_videos = 0  # videos with fewer frames than max_frames, per process (all their frames are used)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """The sample at ``index`` (``"index"`` is the record actually used, after any replacement)."""
        index, visuals = self._visuals_or_replacement(index)
        record = self.records[index]
        instructions = [self._text(t) for t in record.instructions]
        fields = self._visual_fields(visuals, bool(record.video))
        num_images = len(fields[GRID_KEY]) if GRID_KEY in fields else len(visuals)
        if record.video:  # after the text processor, which keeps marker groups as they are written
            instructions = expand_video_marker(instructions, num_images)
        return {
            **fields,
            "num_images": num_images,
            "instruction": instructions,
            "output": [self._text(t) for t in record.outputs],
            # What evaluation scores the generated answer against (raw: metrics normalise for themselves).
            "references": list(record.references or record.outputs[-1:]),
            "system": record.system,  # the record's own system turn; None: model.system_prompt
            "where": record.where(),  # names the record in errors found when the batch is tokenized
            "index": index,
        }

    def visual_count(self, index: int) -> int:
        """Visuals sample ``index`` gives the model at most, without reading one: its images, and a video's
        ``max_frames`` frames, or the video as one visual where the processor takes a video whole (Qwen-VL's)."""
        record = self.records[index]
        return len(record.images) + (self._video_visuals() if record.video else 0)

    def _video_visuals(self) -> int:
        return 1 if hasattr(self.vis_processor, "sample_fields") else self.max_frames

    def text_sample(self, index: int) -> dict[str, Any]:
        """The text of sample ``index`` as ``__getitem__`` gives it, without reading an image (a video counts
        ``max_frames`` frames, the most it gives, or one visual: ``visual_count``): for counting its tokens
        (``datasets.lengths``)."""
        record = self.records[index]
        instructions = [self._text(t) for t in record.instructions]
        if record.video:
            instructions = expand_video_marker(instructions, self._video_visuals())
        sample = {"instruction": instructions, "output": [self._text(t) for t in record.outputs],
                  "num_images": self.visual_count(index), "system": record.system}
        sizes = self.image_sizes(index)
        return sample if sizes is None else {**sample, "image_sizes": sizes}

    def image_sizes(self, index: int) -> list[tuple[int, ...]] | None:
        """Each image's size as the model receives it (a video's ``max_frames`` frames), without decoding an image:
        the processor's square ``image_size`` as (height, width); for a processor that keeps each image's size
        (``grid_of_size``, Qwen-VL's) the image's grid row (t, h, w) from the size its file's header gives, and a
        video's from its frame size and count (``grid_of_video``). None where the processor tells no size.

        Raises :class:`InputError` naming the record for a file of such a processor whose header does not read: its
        tokens cannot be counted without it (a token budget, ``run.batch_unit: tokens``, plans by them)."""
        side = getattr(self.vis_processor, "image_size", None)
        record = self.records[index]
        if isinstance(side, int):
            return [(side, side)] * self.visual_count(index)
        grid_of_size = getattr(self.vis_processor, "grid_of_size", None)
        if grid_of_size is None:
            return None
        if record.video is not None:
            try:
                header = video_header(self.image_root / record.video)
            except UnreadableVideoError as e:
                raise UnreadableVideoError(f"{record.where()}: run.batch_unit: tokens counts a video's tokens by the "
                                           f"frame size and count in its file's header: {e}; fix or remove the file, "
                                           "or set run.batch_unit: samples") from None
            return [self.vis_processor.grid_of_video(header.height, header.width, min(header.frames, self.max_frames))]
        return [self._header_grid(record, name, grid_of_size) for name in record.images]

    def _header_grid(self, record: InstructionRecord, name: str, grid_of_size: Callable[[int, int], tuple[int, ...]]
                     ) -> tuple[int, ...]:
        try:
            return grid_of_size(*self._header_size(name))
        except Exception as e:  # noqa: BLE001  (PIL raises OSError, SyntaxError, ...)
            raise UnreadableImageError(
                f"{record.where()}: run.batch_unit: tokens counts an image's tokens by the size in its file's header, "
                f"and image file {self.image_root / name} has none that reads ({type(e).__name__}: {e}); fix or remove "
                "the file, or set run.batch_unit: samples") from None

    def _header_size(self, name: str) -> tuple[int, int]:
        """(height, width) of an image file as its header gives it: PIL reads no pixels to tell the size."""
        with Image.open(self.image_root / name) as image:
            return image.height, image.width

    def image_name(self, index: int) -> str | None:
        """The record's image (or video) path as the annotation file gives it, several joined by ", " (for reports)."""
        return self.records[index].image

    def _text(self, text: str) -> str:
        return text if self.text_processor is None else process_text(text, self.text_processor)

    def _visual_fields(self, visuals: list[Image.Image], video: bool) -> dict[str, Any]:
        return visual_fields(self.vis_processor, visuals, video)

    def _visuals_or_replacement(self, index: int) -> tuple[int, list[Image.Image]]:
        if not self.replace_unreadable_images:
            return index, self._load_visuals(self.records[index])
        first_error = None
        for step in range(min(MAX_CONSECUTIVE_REPLACEMENTS, len(self.records))):
            candidate = (index + step) % len(self.records)
            try:
                visuals = self._load_visuals(self.records[candidate])
            except OSError as e:
                first_error = first_error or e
                continue
            if step:
                self._count_replacement(first_error, index, candidate)
            return candidate, visuals
        raise UnreadableImageError(f"{first_error}; the images of the next {MAX_CONSECUTIVE_REPLACEMENTS - 1} records are "
                      f"unreadable too, so no replacement was found: is the image root {self.image_root} right?")

    def _count_replacement(self, error: OSError, index: int, replacement: int) -> None:
        self.replaced_images += 1
        n = self.replaced_images
        if n <= 5 or n % 100 == 0:  # the first few, then every hundredth: a log, not a flood
            logger.warning("%s; sample %d replaced by record %d (%d unreadable image(s) replaced so far "
                           "in this process)", error, index, replacement, n)

    def _load_visuals(self, record: InstructionRecord) -> list[Image.Image]:
        """The record's images, or its video's sampled frames; [] for a text-only record."""
        if record.video is None:
            return [self._load_image(record, name) for name in record.images]
        path = self._existing(record, record.video, "video")
        frames = read_frames(path, self.max_frames, record.where())
        if len(frames) < self.max_frames:
            self.short_videos += 1
            if self.short_videos <= MAX_NOTES:
                logger.info("%s: the video has %d frame(s), fewer than max_frames=%d; all are used, one %s each",
                            record.where(), len(frames), self.max_frames, IMAGE_HERE)
        return frames

    def _existing(self, record: InstructionRecord, name: str, kind: str) -> Path:
        path = self.image_root / name
        if not path.is_file():
            raise MissingImageError(f"{record.where()}: {kind} file {path} not found (image root {self.image_root})")
        return path

    def _load_image(self, record: InstructionRecord, name: str) -> Image.Image:
        path = self._existing(record, name, "image")
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
            raise UnreadableImageError(f"{record.where()}: cannot read image file {path}: "
                                       f"{type(e).__name__}: {e}") from e

    @staticmethod
    def collater(samples: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """One flat ``image`` tensor of every sample's images in order (with their grid rows and video seconds where
        the processor keeps each image's size), ``num_images`` per sample; turns as lists of lists (one inner list
        per sample); ``system`` per sample (None: the model's own)."""
        samples = list(samples)
        images = [s["image"] for s in samples if len(s["image"])]
        grids = [s for s in samples if GRID_KEY in s]  # images at their own sizes: flat patches, a grid row each
        own_sizes = {GRID_KEY: torch.cat([s[GRID_KEY] for s in grids]),
                     SECONDS_KEY: [t for s in grids for t in s[SECONDS_KEY]]} if grids else {}
        return {
            **own_sizes,
            # A micro-batch without any image keeps an empty tensor: the model's encoding rule decides what runs.
            "image": torch.cat(images) if images else samples[0]["image"],
            "num_images": [int(s["num_images"]) for s in samples],
            "instruction": [list(s["instruction"]) for s in samples],
            "output": [list(s["output"]) for s in samples],
            "references": [list(s["references"]) for s in samples],
            "system": [s.get("system") for s in samples],
            "where": [s.get("where") for s in samples],
            "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        }
