"""LLaVA conversation JSON (LLaVA-Instruct-150K, llava_v1_5_mix665k, custom LLaVA data) -> records.

A file is a JSON list of
``{"id": ..., "image": "coco/train2017/x.jpg", "conversations": [{"from": "human", "value": "<image>\\nQ"},
{"from": "gpt", "value": "A"}, ...]}``. The conversion follows LLaVA's own
``llava/train/train.py``:

- turns alternate ``human``, ``gpt``; a conversation that opens with a ``gpt``
  turn loses that turn (LLaVA skips it: it answers no question);
- ``<image>`` is removed from its turn and the image goes in front of that turn's
  text (LLaVA moves it to the front too); one image per record, in a ``human`` turn;
  a record with an image but no ``<image>`` gets the image in front of its first question;
- each ``human``/``gpt`` pair becomes one instruction/output turn.

Records without ``"image"`` (mix665k's ~40k text-only ShareGPT conversations)
cannot be served: BLIP2-Qwen puts an image into every sample. They are bad
records of kind ``text_only``: an error by default, skipped and counted with
``skip_text_only: true`` (or ``skip_bad_records: true``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from lavis_ds.datasets.records import IMAGE_HERE, IMAGE_PLACEHOLDER, BadRecord, InstructionRecord, record_where

LLAVA_IMAGE_TOKEN = "<image>"
HUMAN, GPT = "human", "gpt"


def parse_llava_file(raw: Any, source: Path) -> Iterator[InstructionRecord | BadRecord]:
    """The LLaVA conversation format as a :data:`~lavis_ds.datasets.loading.ParseFile`."""
    if not isinstance(raw, list):
        raise ValueError(f"{source}: expected a JSON list of LLaVA records ({{id, image, conversations}}), "
                         f"got a {type(raw).__name__}")
    for position, item in enumerate(raw):
        try:
            yield parse_llava_record(item, source, position)
        except BadRecord as bad:
            yield bad


def parse_llava_record(raw: Any, source: Path, position: int) -> InstructionRecord:
    """One LLaVA record as instruction/output turns; raise :class:`BadRecord` saying what is wrong."""
    if not isinstance(raw, dict):
        raise BadRecord(record_where(source, position),
                        f"expected an object with keys id, image, conversations; got {type(raw).__name__}")
    record_id = raw.get("id")
    image = raw.get("image")
    where = record_where(source, position, record_id=record_id, image=image if isinstance(image, str) else None)
    if "image" not in raw:
        raise BadRecord(where, f"no 'image' key (record has {sorted(raw)}): a text-only conversation; BLIP2-Qwen "
                               f"samples always have an image, so set `skip_text_only: true` in the dataset "
                               f"section to leave text-only records out", BadRecord.TEXT_ONLY)
    if isinstance(image, list):
        raise BadRecord(where, f"'image' is a list of {len(image)}: one image per record is supported")
    if not isinstance(image, str) or not image:
        raise BadRecord(where, f"'image' must be a non-empty string (a path under the image root), got {image!r}")
    if "conversations" not in raw:
        raise BadRecord(where, f"missing key 'conversations' (record has {sorted(raw)})")
    turns = _checked_turns(raw["conversations"], where)
    instructions, outputs = _pairs(turns, where)
    return InstructionRecord(image, instructions, outputs, source, position, record_id=record_id)


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


def _pairs(turns: list[tuple[int, str, str]], where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Alternating human/gpt turns -> (instructions, outputs), the image placeholder where ``<image>`` was."""
    for n, (i, role, _) in enumerate(turns):
        expected = HUMAN if n % 2 == 0 else GPT
        if role != expected:
            raise BadRecord(where, f"conversations[{i}] is from {role!r} but a {expected!r} turn must come "
                                   f"there (turns alternate {HUMAN!r}, {GPT!r}, ...)")
    if len(turns) % 2:
        raise BadRecord(where, f"conversations[{turns[-1][0]}] is a {HUMAN!r} turn with no {GPT!r} answer after it")
    marked = [(i, role) for i, role, text in turns if LLAVA_IMAGE_TOKEN in text]
    if sum(text.count(LLAVA_IMAGE_TOKEN) for _, _, text in turns) > 1:
        raise BadRecord(where, f"{LLAVA_IMAGE_TOKEN!r} appears more than once (in conversations"
                               f"{[i for i, _ in marked]}); one image per record is supported")
    if marked and marked[0][1] == GPT:
        raise BadRecord(where, f"conversations[{marked[0][0]}] is a {GPT!r} turn with {LLAVA_IMAGE_TOKEN!r}; "
                               f"the image belongs to a {HUMAN!r} turn")
    instructions, outputs = [], []
    for (i, _, question), (j, _, answer) in zip(turns[0::2], turns[1::2]):
        text = question.replace(LLAVA_IMAGE_TOKEN, "").strip()
        # No <image> anywhere: the image goes before the first question, as the prompt would put it.
        with_image = LLAVA_IMAGE_TOKEN in question or (not marked and not instructions)
        if with_image:
            text = f"{IMAGE_PLACEHOLDER} {text}" if text else IMAGE_PLACEHOLDER
        elif not text:
            raise BadRecord(where, f"conversations[{i}] ({HUMAN!r}) is empty")
        if not answer.strip():
            raise BadRecord(where, f"conversations[{j}] ({GPT!r}) is empty: there is no answer to learn")
        instructions.append(text)
        outputs.append(answer)
    return tuple(instructions), tuple(outputs)
