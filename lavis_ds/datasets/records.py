"""The instruction record every annotation format is converted into, and the error for a bad one.

A record is one training sample: an image path (relative to the image root) and
instruction/output turns, plus where it came from so that any later problem can
name the annotation file and the record.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Where the model splices in the projected query embeddings; text processors
# must never see it (blip_caption would lowercase it into something unrecognisable).
IMAGE_PLACEHOLDER = "<Img><ImageHere></Img>"
IMAGE_HERE = "<ImageHere>"  # the marker inside IMAGE_PLACEHOLDER that the prompt counts


def record_where(source: Path, position: int, *, list_name: str | None = None,
                 record_id: str | int | None = None, image: str | None = None) -> str:
    """``"<file>: record 3 (id 'x', image 'a.jpg')"``; ``list_name`` names a nested list (``annotations[3]``)."""
    label = f"{list_name}[{position}]" if list_name else f"record {position}"
    details = ([f"id {record_id!r}"] if record_id is not None else []) + ([f"image {image!r}"] if image else [])
    return f"{source}: {label}" + (f" ({', '.join(details)})" if details else "")


@dataclass(frozen=True, slots=True)  # slots: datasets hold hundreds of thousands of these
class InstructionRecord:
    """One validated sample; turns are always tuples (length 1 for single turn)."""

    image: str
    instructions: tuple[str, ...]
    outputs: tuple[str, ...]
    source: Path  # annotation file, for error messages
    position: int  # index of the record inside ``source`` (inside ``list_name`` if given)
    record_id: str | int | None = None  # the record's own id, if the format has one
    list_name: str | None = None  # e.g. "annotations" for official COCO files; None: the file is the list
    # Every acceptable answer of the last turn, for evaluation (COCO's five captions, VQAv2's ten answers);
    # None: the last output is the only one. Evaluation keeps them together on one sample.
    references: tuple[str, ...] | None = None

    def where(self) -> str:
        return record_where(self.source, self.position, list_name=self.list_name, record_id=self.record_id,
                            image=self.image)


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
