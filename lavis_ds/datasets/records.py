"""The instruction record every annotation format is converted into, and the error for a bad one.

A record is one training sample: its visual input (0..N images, or one video whose
sampled frames become the images), instruction/output turns, plus where it came from
so that any later problem can name the annotation file and the record.

Markers: each image has its own ``<ImageHere>`` in the instructions, in image order
(MiniGPT4Qwen writes ``<Img><ImageHere></Img>`` per image; for several,
MPP-LLaVA's ``cli_demo.py`` writes ``<Img><ImageHere><ImageHere></Img>``). A video has
one marker, which becomes one marker per sampled frame when the frames are known
(as MPP-LLaVA's ``video_instructions.py`` does). A record with exactly one image or
video may leave its marker out (COCO-caption style data): the image then goes in
front of the first question.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

# Where the model splices in the projected query embeddings; text processors
# must never see it (blip_caption would lowercase it into something unrecognisable).
IMAGE_PLACEHOLDER = "<Img><ImageHere></Img>"
IMAGE_HERE = "<ImageHere>"  # the marker inside IMAGE_PLACEHOLDER that the prompt counts


def record_where(source: Path, position: int, *, list_name: str | None = None,
                 record_id: str | int | None = None, image: str | None = None, visual: str | None = None) -> str:
    """``"<file>: record 3 (id 'x', image 'a.jpg')"``; ``list_name`` names a nested list (``annotations[3]``).

    ``image``: one image path; ``visual``: a label already made (:attr:`InstructionRecord.visual_label`).
    """
    label = f"{list_name}[{position}]" if list_name else f"record {position}"
    visual = visual or (f"image {image!r}" if image else None)
    details = ([f"id {record_id!r}"] if record_id is not None else []) + ([visual] if visual else [])
    return f"{source}: {label}" + (f" ({', '.join(details)})" if details else "")


def count_markers(turns: Sequence[str]) -> int:
    return sum(turn.count(IMAGE_HERE) for turn in turns)


@dataclass(frozen=True, slots=True)  # slots: datasets hold hundreds of thousands of these
class InstructionRecord:
    """One validated sample; turns are always tuples (length 1 for single turn)."""

    images: tuple[str, ...]  # image paths under the image root, in marker order; () for text-only or video
    instructions: tuple[str, ...]
    outputs: tuple[str, ...]
    source: Path  # annotation file, for error messages
    position: int  # index of the record inside ``source`` (inside ``list_name`` if given)
    record_id: str | int | None = None  # the record's own id, if the format has one
    list_name: str | None = None  # e.g. "annotations" for official COCO files; None: the file is the list
    # Every acceptable answer of the last turn, for evaluation (COCO's five captions, VQAv2's ten answers);
    # None: the last output is the only one. Evaluation keeps them together on one sample.
    references: tuple[str, ...] | None = None
    video: str | None = None  # a video under the same root: its sampled frames are the record's images
    # The record's own system turn (ms-swift's first {"role": "system"} message, LLaMA-Factory's `system` column);
    # None: the model's configured system prompt (model.system_prompt) is used.
    system: str | None = None

    @property
    def files(self) -> tuple[str, ...]:
        """Every visual file the record reads (to check that each exists)."""
        return self.images + ((self.video,) if self.video else ())

    @property
    def image(self) -> str | None:
        """The record's visual input as one string for reports and predictions: the image or video path,
        several images joined by ``", "``; None for a text-only record."""
        return ", ".join(self.files) or None

    @property
    def visual_label(self) -> str | None:
        """How messages name the visual input: ``image 'a.jpg'``, ``images ['a.jpg', 'b.jpg']``, ``video 'v.mp4'``."""
        if self.video:
            return f"video {self.video!r}"
        if len(self.images) > 1:
            return f"images {list(self.images)}"
        return f"image {self.images[0]!r}" if self.images else None

    def where(self) -> str:
        return record_where(self.source, self.position, list_name=self.list_name, record_id=self.record_id,
                            visual=self.visual_label)

    def marker_problem(self) -> str | None:
        """Why the instructions' ``<ImageHere>`` markers do not fit the visual input, or None if they do."""
        markers = count_markers(self.instructions)
        if self.video and self.images:
            return "has both images and a video; a record holds images or one video"
        wanted = 1 if self.video else len(self.images)
        if markers == wanted or (markers == 0 and wanted == 1):
            return None
        what = "a video (one marker, repeated per sampled frame)" if self.video else f"{wanted} image(s)"
        return (f"{markers} {IMAGE_HERE} marker(s) in its instructions but {what}: valid is one {IMAGE_HERE} per "
                f"image, in image order" + (" (or none, for one image: it then goes in front of the first question)"
                                            if wanted == 1 else ""))


@dataclass(frozen=True, slots=True)
class PairRecord(InstructionRecord):
    """One preference pair: the chosen conversation as an instruction record (prompt turns, earlier answers, and
    the chosen last answer as its last output) plus the rejected last answer. Both sides share the prompt turns,
    the earlier answers and the images."""

    rejected: str = ""

    @property
    def chosen(self) -> str:
        return self.outputs[-1]

    @property
    def history(self) -> tuple[str, ...]:
        """The answers of the earlier turns (prompt for both sides)."""
        return self.outputs[:-1]


class BadRecord(ValueError):
    """Why one annotation record cannot be used.

    ``kind`` says which skip switch covers it: every kind is skipped by
    ``skip_bad_records``; ``TEXT_ONLY`` also by ``skip_text_only``.
    """

    MALFORMED = "malformed"
    MISSING_IMAGE = "missing_image"
    TEXT_ONLY = "text_only"

    def __init__(self, where: str, problem: str, kind: str = MALFORMED):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem, self.kind = where, problem, kind

    def __reduce__(self):  # picklable although __init__ takes more than the message
        return type(self), (self.where, self.problem, self.kind)


def each_record(raw: Any, source: Path, what: str, parse: Callable[[Any, Path, int], Any]) -> Iterator[Any]:
    """The records of a JSON list ``raw`` read from ``source``, each ``parse(item, source, position)``; a record
    ``parse`` refuses comes as its :class:`BadRecord` (the loader reports them all at once). ``what`` names the
    records a file of this format lists, for the message when ``raw`` is no list."""
    if not isinstance(raw, list):
        raise ValueError(f"{source}: expected a JSON list of {what}, got a {type(raw).__name__}")
    for position, item in enumerate(raw):
        try:
            yield parse(item, source, position)
        except BadRecord as bad:
            yield bad
