"""COCO-caption JSON -> records: one caption instruction, the caption as the answer.

Two layouts are read:

- LAVIS / Karpathy (``coco_karpathy_train.json``, ``_val``, ``_test``): a JSON list of
  ``{"image": "val2014/COCO_val2014_000000391895.jpg", "caption": "...", "image_id": "..."}``.
  ``caption`` may be a list of references (Karpathy val/test). For training each
  reference becomes its own sample (the layout of Karpathy train); for evaluation
  (``group_references=True``) the record stays one sample holding all its references.
- Official COCO (``captions_train2017.json``): ``{"images": [{"id", "file_name"}, ...],
  "annotations": [{"id", "image_id", "caption"}, ...]}``; one sample per annotation,
  or for evaluation one sample per image with all its captions; the image path is the
  image's ``file_name`` (so the image root is e.g. ``train2017/``).

The instruction is the configured prompt; without the image placeholder in it,
the image goes in front.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

from lavis_ds.datasets.records import IMAGE_HERE, IMAGE_PLACEHOLDER, BadRecord, InstructionRecord, record_where

DEFAULT_CAPTION_PROMPT = "Describe this image in one sentence."


def caption_instruction(prompt: str) -> str:
    """The instruction of every caption sample: ``prompt`` with the image placeholder (in front unless placed)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt: expected a non-empty string, got {prompt!r}")
    markers = prompt.count(IMAGE_HERE)
    if markers > 1:
        raise ValueError(f"prompt: {IMAGE_HERE!r} appears {markers} times in {prompt!r}; one image per sample")
    return prompt if markers else f"{IMAGE_PLACEHOLDER} {prompt.strip()}"


def parse_coco_caption_file(raw: Any, source: Path, prompt: str = DEFAULT_CAPTION_PROMPT,
                            group_references: bool = False) -> Iterator[InstructionRecord | BadRecord]:
    """Either COCO-caption layout as a :data:`~lavis_ds.datasets.loading.ParseFile` (bind the options first).

    ``group_references``: one sample per image with every caption as a reference (evaluation), instead
    of one sample per caption (training).
    """
    instruction = caption_instruction(prompt)
    if isinstance(raw, list):
        return _karpathy(raw, source, instruction, group_references)
    if isinstance(raw, dict) and "images" in raw and "annotations" in raw:
        records = _official(raw, source, instruction)
        return _grouped_by_image(records) if group_references else records
    found = f"an object with keys {sorted(raw)}" if isinstance(raw, dict) else f"a {type(raw).__name__}"
    raise ValueError(f"{source}: expected a list of {{image, caption}} records (LAVIS/Karpathy) or an official "
                     f"COCO captions file (an object with 'images' and 'annotations'), got {found}")


def _caption(value: Any, where: str, key: str = "caption") -> str:
    if not isinstance(value, str):
        raise BadRecord(where, f"{key!r} must be a string, got {type(value).__name__}: {value!r}")
    if not value.strip():
        raise BadRecord(where, f"{key!r} is empty")
    return value


def _karpathy(raw: list, source: Path, instruction: str, group: bool) -> Iterator[InstructionRecord | BadRecord]:
    for position, item in enumerate(raw):
        try:
            records = _karpathy_record(item, source, position, instruction)
        except BadRecord as bad:
            yield bad
            continue
        if group:
            yield dataclasses.replace(records[0], references=tuple(r.outputs[0] for r in records))
        else:
            yield from records


def _karpathy_record(raw: Any, source: Path, position: int, instruction: str) -> list[InstructionRecord]:
    if not isinstance(raw, dict):
        raise BadRecord(record_where(source, position),
                        f"expected an object with keys image, caption; got {type(raw).__name__}")
    image, record_id = raw.get("image"), raw.get("image_id")
    where = record_where(source, position, record_id=record_id, image=image if isinstance(image, str) else None)
    missing = [key for key in ("image", "caption") if key not in raw]
    if missing:
        raise BadRecord(where, f"missing key(s) {', '.join(map(repr, missing))} (record has {sorted(raw)})")
    if not isinstance(image, str) or not image:
        raise BadRecord(where, f"'image' must be a non-empty string (a path under the image root), got {image!r}")
    captions = raw["caption"]
    if isinstance(captions, list):
        if not captions:
            raise BadRecord(where, "'caption' is an empty list")
        captions = [_caption(c, where, f"caption[{k}]") for k, c in enumerate(captions)]
    else:
        captions = [_caption(captions, where)]
    return [InstructionRecord((image,), (instruction,), (c,), source, position, record_id=record_id)
            for c in captions]


def _official(raw: dict, source: Path, instruction: str) -> Iterator[InstructionRecord | BadRecord]:
    images, annotations = raw["images"], raw["annotations"]
    for key, value in (("images", images), ("annotations", annotations)):
        if not isinstance(value, list):
            raise ValueError(f"{source}: '{key}' must be a list, got {type(value).__name__}")
    file_names: dict[Any, str] = {}
    for position, entry in enumerate(images):
        where = record_where(source, position, list_name="images")
        if (not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str)
                or not isinstance(entry.get("id"), (int, str))):
            yield BadRecord(where, f"an image entry needs an 'id' (integer or string) and a string 'file_name', "
                                   f"got {entry!r}")
        elif entry["id"] in file_names:
            yield BadRecord(where, f"image id {entry['id']!r} is listed twice")
        else:
            file_names[entry["id"]] = entry["file_name"]
    for position, ann in enumerate(annotations):
        try:
            yield _official_annotation(ann, source, position, instruction, file_names)
        except BadRecord as bad:
            yield bad


def _grouped_by_image(items: Iterator[InstructionRecord | BadRecord]) -> Iterator[InstructionRecord | BadRecord]:
    """Official annotations merged per image, in order of each image's first caption; bad ones pass through."""
    by_image: dict[str, list[InstructionRecord]] = {}
    for item in items:
        if isinstance(item, BadRecord):
            yield item
        else:
            by_image.setdefault(item.image, []).append(item)
    for records in by_image.values():
        yield dataclasses.replace(records[0], references=tuple(r.outputs[0] for r in records))


def _official_annotation(ann: Any, source: Path, position: int, instruction: str,
                         file_names: dict[Any, str]) -> InstructionRecord:
    record_id = ann.get("id") if isinstance(ann, dict) else None
    where = record_where(source, position, list_name="annotations", record_id=record_id)
    if not isinstance(ann, dict):
        raise BadRecord(where, f"expected an object with keys image_id, caption; got {type(ann).__name__}")
    missing = [key for key in ("image_id", "caption") if key not in ann]
    if missing:
        raise BadRecord(where, f"missing key(s) {', '.join(map(repr, missing))} (annotation has {sorted(ann)})")
    if not isinstance(ann["image_id"], (int, str)) or ann["image_id"] not in file_names:
        raise BadRecord(where, f"image_id {ann['image_id']!r} is not among the file's 'images'")
    caption = _caption(ann["caption"], where)
    return InstructionRecord((file_names[ann["image_id"]],), (instruction,), (caption,), source, position,
                             record_id=record_id, list_name="annotations")
