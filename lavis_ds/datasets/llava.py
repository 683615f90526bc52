"""LLaVA conversation JSON (LLaVA-Instruct-150K, llava_v1_5_mix665k, custom LLaVA data) -> records.

A file is a JSON list of
``{"id": ..., "image": "coco/train2017/x.jpg", "conversations": [{"from": "human", "value": "<image>\\nQ"},
{"from": "gpt", "value": "A"}, ...]}``. The conversion follows LLaVA's own
``llava/train/train.py``:

- turns alternate ``human``, ``gpt``; a conversation that opens with a ``gpt``
  turn loses that turn (LLaVA skips it: it answers no question);
- a turn with one ``<image>`` has it removed and the image put in front of that turn's
  text (LLaVA moves it to the front too); a record with one image but no ``<image>``
  gets the image in front of its first question;
- several images (``"image": [...]``, the multi-image format of LLaVA-NeXT's
  ``llava/train/train.py``) need one ``<image>`` each, in ``human`` turns, in image
  order; a turn with several keeps them where they stand (LLaVA-NeXT moves only a
  turn's single ``<image>`` to its front);
- each ``human``/``gpt`` pair becomes one instruction/output turn.

Records without ``"image"`` (mix665k's ~40k text-only ShareGPT conversations) are
text-only samples, trained in the same batches as the others. ``skip_text_only:
true`` in the section leaves them out instead (counted and logged): they are then
bad records of kind ``text_only``.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Iterator

from lavis_ds.datasets.records import (IMAGE_HERE, IMAGE_PLACEHOLDER, BadRecord, InstructionRecord, each_record,
                                       record_where)

LLAVA_IMAGE_TOKEN = "<image>"
HUMAN, GPT = "human", "gpt"


def parse_llava_file(raw: Any, source: Path, skip_text_only: bool = False) -> Iterator[InstructionRecord | BadRecord]:
    """The LLaVA conversation format as a :data:`~lavis_ds.datasets.loading.ParseFile`.

    ``skip_text_only``: a record without ``image`` is a bad record of kind ``text_only`` (for a loader
    that skips that kind) instead of a text-only sample.
    """
    yield from each_record(raw, source, "LLaVA records ({id, image, conversations})",
                           lambda item, source, position: parse_llava_record(item, source, position, skip_text_only))


def llava_parser(skip_text_only: bool):
    """``parse_llava_file`` with its option bound (what a builder hands its loader)."""
    return functools.partial(parse_llava_file, skip_text_only=skip_text_only) if skip_text_only else parse_llava_file


def _images(raw: dict, where: str, skip_text_only: bool) -> tuple[str, ...]:
    if "image" not in raw:
        if skip_text_only:
            raise BadRecord(where, f"no 'image' key (record has {sorted(raw)}): a text-only conversation, left "
                                   f"out because the section sets `skip_text_only: true`", BadRecord.TEXT_ONLY)
        return ()
    image = raw["image"]
    images = image if isinstance(image, list) else [image]
    if not images or not all(isinstance(i, str) and i for i in images):
        raise BadRecord(where, f"'image' must be a non-empty string or a non-empty list of them (paths under the "
                               f"image root), got {image!r}")
    return tuple(images)


def parse_llava_record(raw: Any, source: Path, position: int, skip_text_only: bool = False) -> InstructionRecord:
    """One LLaVA record as instruction/output turns; raise :class:`BadRecord` saying what is wrong."""
    if not isinstance(raw, dict):
        raise BadRecord(record_where(source, position),
                        f"expected an object with keys id, image, conversations; got {type(raw).__name__}")
    record_id = raw.get("id")
    image = raw.get("image")
    where = record_where(source, position, record_id=record_id, image=image if isinstance(image, str) else None,
                         visual=f"images {image}" if isinstance(image, list) else None)
    images = _images(raw, where, skip_text_only)
    if "conversations" not in raw:
        raise BadRecord(where, f"missing key 'conversations' (record has {sorted(raw)})")
    turns = _checked_turns(raw["conversations"], where)
    instructions, outputs = conversation_pairs(turns, where, len(images))
    return InstructionRecord(images, instructions, outputs, source, position, record_id=record_id)


def _checked_turns(conversations: Any, where: str) -> list[tuple[int, str, str]]:
    """``[(position in conversations, role, text)]``, each turn's shape checked."""
    if not isinstance(conversations, list):
        raise BadRecord(where, f"'conversations' must be a list of {{from, value}} turns, "
                               f"got {type(conversations).__name__}")
    if not conversations:
        raise BadRecord(where, "'conversations' is empty")
    turns = []
    for i, turn in enumerate(conversations):
        key = f"conversations[{i}]"
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise BadRecord(where, f"{key} must be an object with keys 'from' and 'value', got {turn!r}")
        role, text = turn["from"], turn["value"]
        if role not in (HUMAN, GPT):
            raise BadRecord(where, f"{key}.from is {role!r}; valid: {HUMAN!r}, {GPT!r}")
        if not isinstance(text, str):
            raise BadRecord(where, f"{key}.value must be a string, got {type(text).__name__}: {text!r}")
        if IMAGE_HERE in text:
            raise BadRecord(where, f"{key}.value contains {IMAGE_HERE!r}, lavis_ds's own image marker; "
                                   f"LLaVA data marks the image with {LLAVA_IMAGE_TOKEN!r}")
        turns.append((i, role, text))
    if turns[0][1] == GPT:
        turns = turns[1:]  # as LLaVA's train.py: an opening gpt turn answers no question
        if not turns:
            raise BadRecord(where, "'conversations' holds only one 'gpt' turn and no question")
    return turns


def _check_markers(turns: list[tuple[int, str, str]], where: str, num_images: int) -> bool:
    """Whether the record marks its images; raises unless it has one ``<image>`` per image, in human turns
    (one image may go unmarked)."""
    marked = [(i, role) for i, role, text in turns if LLAVA_IMAGE_TOKEN in text]
    for i, role in marked:
        if role == GPT:
            raise BadRecord(where, f"conversations[{i}] is a {GPT!r} turn with {LLAVA_IMAGE_TOKEN!r}; "
                                   f"images belong to {HUMAN!r} turns")
    count = sum(text.count(LLAVA_IMAGE_TOKEN) for _, _, text in turns)
    if count != num_images and not (count == 0 and num_images == 1):
        images = f"{num_images} image(s) in 'image'" if num_images else "no 'image' key (a text-only record)"
        raise BadRecord(where, f"{LLAVA_IMAGE_TOKEN!r} appears {count} time(s) (in conversations"
                               f"{[i for i, _ in marked]}) but the record has {images}: valid is one "
                               f"{LLAVA_IMAGE_TOKEN!r} per image, in image order" +
                               (" (or none for one image)" if num_images == 1 else ""))
    return bool(marked)


def _question(text: str, with_image: bool) -> str:
    """A human turn with lavis_ds's markers: a single ``<image>`` moves to the front (as LLaVA does), several
    stay where they stand."""
    if text.count(LLAVA_IMAGE_TOKEN) > 1:
        return text.replace(LLAVA_IMAGE_TOKEN, IMAGE_PLACEHOLDER).strip()
    text = text.replace(LLAVA_IMAGE_TOKEN, "").strip()
    if with_image:
        return f"{IMAGE_PLACEHOLDER} {text}" if text else IMAGE_PLACEHOLDER
    return text


def conversation_pairs(turns: list[tuple[int, str, str]], where: str,
                       num_images: int = 1) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Alternating human/gpt turns -> (instructions, outputs), the image placeholders where ``<image>`` was."""
    for n, (i, role, _) in enumerate(turns):
        expected = HUMAN if n % 2 == 0 else GPT
        if role != expected:
            raise BadRecord(where, f"conversations[{i}] is from {role!r} but a {expected!r} turn must come "
                                   f"there (turns alternate {HUMAN!r}, {GPT!r}, ...)")
    if len(turns) % 2:
        raise BadRecord(where, f"conversations[{turns[-1][0]}] is a {HUMAN!r} turn with no {GPT!r} answer after it")
    marked = _check_markers(turns, where, num_images)
    instructions, outputs = [], []
    for (i, _, question), (j, _, answer) in zip(turns[0::2], turns[1::2]):
        # One unmarked image goes before the first question, as the prompt would put it.
        with_image = LLAVA_IMAGE_TOKEN in question or (num_images == 1 and not marked and not instructions)
        text = _question(question, with_image)
        if not text:
            raise BadRecord(where, f"conversations[{i}] ({HUMAN!r}) is empty")
        if not answer.strip():
            raise BadRecord(where, f"conversations[{j}] ({GPT!r}) is empty: there is no answer to learn")
        instructions.append(text)
        outputs.append(answer)
    return tuple(instructions), tuple(outputs)
