"""Chat records with roles, as LLaMA-Factory and ms-swift write them -> instruction records with their system turn.

- LLaMA-Factory's sharegpt format (``data/README.md``): ``conversations`` of ``{"from", "value"}`` turns with
  ``human``/``gpt``/``system`` (its default tags), or ``messages`` of ``{"role", "content"}`` turns with
  ``user``/``assistant``/``system`` (the OpenAI-style tags of ``mllm_demo.json``); the system prompt is a first
  ``system`` turn or the ``system`` column; ``images`` a list of paths, each marked ``<image>`` in a user turn.
- ms-swift's standard format (``docs/source_en/Customization/Custom-dataset.md``): ``messages`` of ``{"role",
  "content"}``, optionally opening with ``{"role": "system", ...}``, and ``images``.

The record's system turn is its own system prompt: the model renders it where its chat template puts a system
message, instead of ``model.system_prompt`` (``lavis_ds.models.prompt``; ``model.record_system_prompt`` says
otherwise). Images follow LLaVA's rules (``lavis_ds.datasets.llava.conversation_pairs``): one ``<image>`` per
image, a turn's single ``<image>`` goes to the front of that turn, one image may go unmarked.
The preference formats (``lavis_ds.datasets.preference``) read their turns with the same functions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from lavis_ds.datasets.llava import GPT, HUMAN, conversation_pairs
from lavis_ds.datasets.records import BadRecord, InstructionRecord, each_record, record_where

SYSTEM = "system"
ROLES = {"human": HUMAN, "user": HUMAN, "gpt": GPT, "assistant": GPT, "system": SYSTEM}
Turn = tuple[int, str, str]  # (position in the record's list, role as human/gpt/system, text)


def turn_of(turn: Any, key: str, where: str) -> tuple[str, str]:
    """``(role, text)`` of a ``{from, value}`` or ``{role, content}`` turn, the role as ``human``/``gpt``/``system``."""
    if isinstance(turn, dict) and {"from", "value"} <= set(turn):
        role, text = turn["from"], turn["value"]
    elif isinstance(turn, dict) and {"role", "content"} <= set(turn):
        role, text = turn["role"], turn["content"]
    else:
        raise BadRecord(where, f"{key} must be a turn {{'from', 'value'}} or {{'role', 'content'}}, got {turn!r}")
    if role not in ROLES:
        raise BadRecord(where, f"{key} has role {role!r}; valid: {', '.join(ROLES)}")
    if not isinstance(text, str):
        raise BadRecord(where, f"{key}'s text must be a string, got {type(text).__name__}: {text!r}")
    return ROLES[role], text


def conversation(raw: Any, key: str, where: str) -> tuple[str | None, list[Turn]]:
    """``(system prompt or None, [(position, role, text)])`` of a list of turns: a system turn may open it, once."""
    if not isinstance(raw, list) or not raw:
        raise BadRecord(where, f"{key!r} must be a non-empty list of turns, got {raw!r}")
    turns = [(i, *turn_of(t, f"{key}[{i}]", where)) for i, t in enumerate(raw)]
    systems = [i for i, role, _ in turns if role == SYSTEM]
    if len(systems) > 1:
        raise BadRecord(where, f"{key}[{systems[0]}] and {key}[{systems[1]}] are both system turns: a conversation "
                               f"has one system prompt, its first turn; join their texts into it")
    if systems and systems[0] != 0:
        raise BadRecord(where, f"{key}[{systems[0]}] is a system turn but not the first turn: the system prompt "
                               f"opens the conversation (move it to {key}[0])")
    if not systems:
        return None, turns
    return turns[0][2] or None, turns[1:]


def record_system(raw: dict, turn_system: str | None, key: str, where: str) -> str | None:
    """The record's system prompt: its first system turn or LLaMA-Factory's ``system`` column (not both)."""
    column = raw.get("system")
    if column is not None and not isinstance(column, str):
        raise BadRecord(where, f"'system' must be a string (the record's system prompt), got {column!r}"[:300])
    if column and turn_system is not None and column != turn_system:
        raise BadRecord(where, f"has a 'system' column ({column[:40]!r}) and a system turn in {key!r} "
                               f"({turn_system[:40]!r}): give the system prompt once")
    return turn_system if turn_system is not None else (column or None)


def images_of(raw: dict, key: str, where: str) -> tuple[str, ...]:
    """``raw[key]`` as image paths: a path or a list of paths (none if the key is absent)."""
    value = raw.get(key, [])
    images = [value] if isinstance(value, str) else value
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise BadRecord(where, f"{key!r} must be a path or a list of paths under the image root, got {value!r}")
    return tuple(images)


def parse_messages_record(raw: Any, source: Path, position: int) -> InstructionRecord:
    """One LLaMA-Factory sharegpt or ms-swift messages SFT record; :class:`BadRecord` says what is wrong."""
    where = record_where(source, position)
    if not isinstance(raw, dict):
        raise BadRecord(where, f"expected an object with 'messages' (or 'conversations'); got {type(raw).__name__}")
    key = "conversations" if "conversations" in raw else "messages"
    if key not in raw:
        raise BadRecord(where, f"missing 'messages' (or 'conversations'): the record's turns (record has "
                               f"{sorted(raw)})")
    images = images_of(raw, "images", where)
    where = record_where(source, position, visual=f"images {list(images)}" if images else None)
    turn_system, turns = conversation(raw[key], key, where)
    system = record_system(raw, turn_system, key, where)
    if not turns:
        raise BadRecord(where, f"{key!r} holds only a system turn: a record needs a user turn and its answer")
    instructions, outputs = conversation_pairs(turns, where, len(images))
    return InstructionRecord(images, instructions, outputs, source, position, system=system)


def parse_messages_file(raw: Any, source: Path) -> Iterator[InstructionRecord | BadRecord]:
    """A JSON list (or JSON Lines) of SFT chat records as a :data:`~lavis_ds.datasets.loading.ParseFile`."""
    yield from each_record(raw, source, "chat records ({messages} or {conversations})", parse_messages_record)
