"""Preference pairs in the formats people have -> :class:`~lavis_ds.datasets.records.PairRecord`, and their dataset.

Each record becomes one pair: shared prompt turns and images, a chosen and a rejected last answer.

- LLaMA-Factory's sharegpt ranking format (``data/dataset_info.json``: ``"ranking": true, "formatting":
  "sharegpt"``; ``data/README.md``): ``conversations`` (or ``messages``) ending with the user's turn,
  ``chosen`` and ``rejected`` one assistant turn each, ``images`` a list of paths. Turns are ``{"from",
  "value"}`` with ``human``/``gpt``/``system`` (its default tags) or ``{"role", "content"}`` with
  ``user``/``assistant``/``system`` (its OpenAI-style tags); the system prompt is a first ``system`` turn or the
  ``system`` column (``lavis_ds.datasets.messages`` reads the turns).
- ms-swift's RLHF format (``docs/source_en/Customization/Custom-dataset.md``): ``messages`` ending with the
  chosen assistant turn, ``images``, and ``rejected_response`` (a string, or one assistant message in a list)
  or ``rejected_messages`` (the whole rejected conversation); ``rejected_images`` may repeat ``images``.
- RLAIF-V-Dataset (openbmb): ``question``, ``chosen``, ``rejected`` and the image (``image_path``, or ``image``
  as a path or ``{"path": ...}``); ``ds_name``, ``origin_dataset``, ``origin_split``, ``idx`` are metadata.
- RLHF-V-Dataset (openbmb): ``text``, a JSON string of ``{"question", "chosen", "rejected"}``, and the image
  as RLAIF-V has it.
- VLFeedback (MMInstruction): ``prompt``, ``img_path`` and ``completions`` rated by GPT-4V in three aspects (a
  list of ``{model, response, annotations}``, or the parquet's one object of equal-length lists); its best and
  worst completion by mean rating make the pair.

Images are marked with ``<image>`` as in LLaVA data (``lavis_ds.datasets.llava``: one per image, one image may
go unmarked and is put in front of the first question). The two sides of a pair share their images and prompt
turns: a record whose sides differ there (ms-swift's ``rejected_images`` naming other images, or
``rejected_messages`` with another prompt) is a bad record naming what differs; so is a missing side.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

from lavis_ds.datasets.instruction import InstructionDataset
from lavis_ds.datasets.llava import GPT, HUMAN, conversation_pairs
from lavis_ds.datasets.messages import conversation, images_of, record_system, turn_of
from lavis_ds.datasets.records import BadRecord, PairRecord, each_record, record_where

def _answer(raw: Any, key: str, where: str) -> str:
    """One assistant answer: a turn object, a list of exactly one assistant turn, or a string."""
    if isinstance(raw, str):
        text = raw
    else:
        turn = raw[0] if isinstance(raw, list) and len(raw) == 1 else raw
        role, text = turn_of(turn, key, where)
        if role != GPT:
            raise BadRecord(where, f"{key} must be an assistant ('gpt' / 'assistant') turn, got role {role!r}")
    if not text.strip():
        raise BadRecord(where, f"{key} is empty: a pair needs two answers to compare")
    return text


def _pair(turns: list[tuple[int, str, str]], chosen: str, rejected: str, images: tuple[str, ...], source: Path,
          position: int, where: str, system: str | None = None, record_id: Any = None) -> PairRecord:
    """A pair from the prompt turns (ending with the user's), both answers and the images."""
    instructions, outputs = conversation_pairs([*turns, (len(turns), GPT, chosen)], where, len(images))
    return PairRecord(images, instructions, outputs, source, position, record_id=record_id, rejected=rejected,
                      system=system)


def _missing(raw: dict, keys: tuple[str, ...], where: str, valid: str) -> None:
    missing = [key for key in keys if key not in raw]
    if missing:
        raise BadRecord(where, f"missing {', '.join(map(repr, missing))} (has {sorted(raw)}); {valid}")


def parse_sharegpt_ranking(raw: Any, source: Path, position: int) -> PairRecord:
    """One LLaMA-Factory sharegpt ranking record."""
    where = record_where(source, position)
    if not isinstance(raw, dict):
        raise BadRecord(where, f"expected an object with conversations, chosen, rejected; got {type(raw).__name__}")
    key = "conversations" if "conversations" in raw else "messages"
    _missing(raw, (key, "chosen", "rejected"), where,
             "a ranking record holds the prompt turns and one chosen and one rejected answer")
    images = images_of(raw, "images", where)
    where = record_where(source, position, visual=f"images {list(images)}" if images else None)
    turn_system, turns = conversation(raw[key], key, where)
    system = record_system(raw, turn_system, key, where)
    if not turns or turns[-1][1] != HUMAN:
        raise BadRecord(where, f"{key!r} must end with the user's turn: the answers to compare are in 'chosen' and "
                               f"'rejected'")
    return _pair(turns, _answer(raw["chosen"], "chosen", where), _answer(raw["rejected"], "rejected", where), images,
                 source, position, where, system)


def parse_swift_rlhf(raw: Any, source: Path, position: int) -> PairRecord:
    """One ms-swift RLHF record (``messages`` + ``rejected_response`` or ``rejected_messages``)."""
    where = record_where(source, position)
    if not isinstance(raw, dict):
        raise BadRecord(where, f"expected an object with messages and rejected_response; got {type(raw).__name__}")
    _missing(raw, ("messages",), where, "ms-swift's RLHF records hold the chosen conversation in 'messages'")
    images = images_of(raw, "images", where)
    where = record_where(source, position, visual=f"images {list(images)}" if images else None)
    if "rejected_images" in raw and images_of(raw, "rejected_images", where) != images:
        raise BadRecord(where, f"'rejected_images' {raw['rejected_images']!r} differ from 'images' {list(images)}: "
                               f"lavis_ds trains pairs whose sides share their images (encoded once per pair); "
                               f"drop 'rejected_images' or make it equal 'images'")
    system, turns = conversation(raw["messages"], "messages", where)
    if not turns or turns[-1][1] != GPT:
        raise BadRecord(where, "'messages' must end with the chosen assistant turn")
    prompt, chosen = turns[:-1], turns[-1][2]
    if "rejected_response" in raw:
        rejected = _answer(raw["rejected_response"], "rejected_response", where)
    elif "rejected_messages" in raw:
        rejected = _rejected_from_messages(raw["rejected_messages"], system, prompt, where)
    else:
        raise BadRecord(where, "no rejected side: give 'rejected_response' (the rejected last answer) or "
                               "'rejected_messages' (the same conversation with the rejected last answer)")
    return _pair(prompt, chosen, rejected, images, source, position, where, system)


def _rejected_from_messages(raw: Any, system: str | None, prompt: list, where: str) -> str:
    """The rejected last answer of ``rejected_messages``, whose other turns must be the chosen side's."""
    rejected_system, turns = conversation(raw, "rejected_messages", where)
    if not turns or turns[-1][1] != GPT:
        raise BadRecord(where, "'rejected_messages' must end with the rejected assistant turn")
    same = rejected_system == system and [t[1:] for t in turns[:-1]] == [t[1:] for t in prompt]
    if not same:
        raise BadRecord(where, f"'rejected_messages' has other prompt turns than 'messages' ({len(turns) - 1} vs "
                               f"{len(prompt)} before the last answer, or other text): the sides of a pair share "
                               f"every turn but the last answer; use 'rejected_response' for that answer")
    return _answer(turns[-1][2], "rejected_messages[-1]", where)


def _image_path(raw: dict, where: str) -> tuple[str, ...]:
    """RLAIF-V / RLHF-V's image: ``image_path``, or ``image`` as a path or as the parquet's ``{"path": ...}``."""
    value = raw.get("image_path") or raw.get("image")
    if isinstance(value, dict):
        value = value.get("path")
    if not isinstance(value, str) or not value:
        raise BadRecord(where, f"no image path: give 'image_path', or 'image' as a path or {{'path': ...}} (record "
                               f"has {sorted(raw)})")
    return (value,)


def _string(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise BadRecord(where, f"{key} must be a string, got {type(value).__name__}: {value!r}"[:300])
    return value


def _qa_pair(fields: Any, key: str, raw: dict, source: Path, position: int) -> PairRecord:
    images = _image_path(raw, record_where(source, position, record_id=raw.get("idx")))
    where = record_where(source, position, record_id=raw.get("idx"), image=images[0])
    if not isinstance(fields, dict):
        raise BadRecord(where, f"{key} must be an object with question, chosen, rejected; got {fields!r}"[:300])
    _missing(fields, ("question", "chosen", "rejected"), where, f"a pair needs its question and both answers "
                                                                f"(in {key})")
    question, chosen, rejected = (_string(fields[k], repr(k), where) for k in ("question", "chosen", "rejected"))
    return _pair([(0, HUMAN, question)], _answer(chosen, "chosen", where), _answer(rejected, "rejected", where),
                 images, source, position, where, record_id=raw.get("idx"))


def parse_rlaif_v(raw: Any, source: Path, position: int) -> PairRecord:
    """One RLAIF-V-Dataset record."""
    if not isinstance(raw, dict):
        raise BadRecord(record_where(source, position), f"expected an object, got {type(raw).__name__}")
    return _qa_pair(raw, "the record", raw, source, position)


def parse_rlhf_v(raw: Any, source: Path, position: int) -> PairRecord:
    """One RLHF-V-Dataset record: its ``text`` is a JSON string of question, chosen, rejected."""
    where = record_where(source, position)
    if not isinstance(raw, dict) or "text" not in raw:
        raise BadRecord(where, f"expected an object with 'text' (JSON of question, chosen, rejected), "
                               f"got {raw!r}"[:300])
    text = raw["text"]
    try:
        fields = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise BadRecord(where, f"'text' is not valid JSON ({e}); RLHF-V's 'text' is a JSON object with question, "
                               f"chosen, rejected") from None
    return _qa_pair(fields, "'text'", raw, source, position)


VLFEEDBACK_ASPECTS = ("Helpfulness", "Visual Faithfulness", "Ethical Considerations")


def parse_vlfeedback(raw: Any, source: Path, position: int) -> PairRecord:
    """One VLFeedback record (``prompt``, ``img_path``, ``completions`` of ``{model, response, annotations}`` rated
    1-5 in three aspects by GPT-4V): the pair of its best and worst completion by mean rating.

    A completion without three numeric ratings (``'N/A'``, missing, null) takes no part: the dataset's own training
    code (vlf-silkie/VLFeedback ``run_dpo.py``) expects ratings that are not numbers and leaves such a completion
    out of every pair too. Equal means go to the completion listed first. A record with fewer than two rated
    completions, or whose rated completions all have the same mean, has no pair to give and is named."""
    where = record_where(source, position, record_id=raw.get("id") if isinstance(raw, dict) else None)
    if not isinstance(raw, dict):
        raise BadRecord(where, f"expected an object with prompt, img_path, completions; got {type(raw).__name__}")
    _missing(raw, ("prompt", "img_path", "completions"), where, "a VLFeedback record rates completions of a prompt")
    images = images_of(raw, "img_path", where)
    where = record_where(source, position, record_id=raw.get("id"), image=images[0] if images else None)
    prompt = _string(raw["prompt"], "'prompt'", where)
    completions = _completion_list(raw["completions"], where)
    rated = [(mean, i) for i, completion in enumerate(completions)
             if (mean := _mean_rating(completion, f"completions[{i}]", where)) is not None]
    if len(rated) < 2:
        raise BadRecord(where, f"{len(rated)} of its {len(completions)} completions have a numeric Rating for each "
                               f"of {', '.join(VLFEEDBACK_ASPECTS)}: the record gives no pair")
    # max/min return the first of equal items: ties go to the completion listed first.
    (best, b), (worst, w) = max(rated, key=lambda r: r[0]), min(rated, key=lambda r: r[0])
    if best == worst:
        raise BadRecord(where, f"its rated completions all have the same mean rating "
                               f"({[round(mean, 2) for mean, _ in rated]}): the record gives no pair")
    chosen, rejected = (_answer(_string(completions[i].get("response"), f"completions[{i}].response", where),
                                f"completions[{i}].response", where) for i in (b, w))
    return _pair([(0, HUMAN, prompt)], chosen, rejected, images, source, position, where, record_id=raw.get("id"))


def _completion_list(raw: Any, where: str) -> list:
    """The completions as a list of ``{model, response, annotations}``. The published parquet stores them as one
    object of equal-length lists (``datasets`` turns a sequence of structs into a struct of sequences), and so does
    JSON written from it."""
    if isinstance(raw, dict):
        lengths = {key: len(value) if isinstance(value, list) else None for key, value in raw.items()}
        if "response" not in raw or None in lengths.values() or len(set(lengths.values())) != 1:
            raise BadRecord(where, f"'completions' as an object must hold lists of equal length, 'response' among "
                                   f"them (as the published parquet does); got {lengths}")
        return [dict(zip(raw, values)) for values in zip(*raw.values())]
    if not isinstance(raw, list):
        raise BadRecord(where, f"'completions' must be a list of rated responses, got {raw!r}"[:300])
    return raw


def _mean_rating(completion: Any, key: str, where: str) -> float | None:
    """The mean of a completion's three aspect ratings (strings in the published file); None when one of them is
    not a number ('N/A', missing, null)."""
    if not isinstance(completion, dict):
        raise BadRecord(where, f"{key} must be an object with response and annotations, got {completion!r}"[:300])
    annotations = completion.get("annotations")
    try:
        ratings = [float(annotations[aspect]["Rating"]) for aspect in VLFEEDBACK_ASPECTS]
    except (KeyError, TypeError, ValueError):
        return None
    return sum(ratings) / len(ratings) if all(map(math.isfinite, ratings)) else None


PAIR_FORMATS: dict[str, Callable[[Any, Path, int], PairRecord]] = {
    "sharegpt": parse_sharegpt_ranking, "swift": parse_swift_rlhf, "rlaif_v": parse_rlaif_v, "rlhf_v": parse_rlhf_v,
    "vlfeedback": parse_vlfeedback}


def parse_pair_file(raw: Any, source: Path, pair_format: str) -> Iterator[PairRecord | BadRecord]:
    """A JSON list of pair records in ``pair_format`` (a key of :data:`PAIR_FORMATS`) as a ``ParseFile``."""
    yield from each_record(raw, source, f"{pair_format} preference records", PAIR_FORMATS[pair_format])


def pair_parser(pair_format: str):
    """``parse_pair_file`` with its format bound (what a builder hands its loader)."""
    if pair_format not in PAIR_FORMATS:
        raise ValueError(f"pair_format: {pair_format!r} is not a known preference format; valid: "
                         f"{', '.join(PAIR_FORMATS)}")
    return functools.partial(parse_pair_file, pair_format=pair_format)


class PairDataset(InstructionDataset):
    """Preference pairs: a sample is one pair, its images loaded once for both sides.

    A sample holds ``image`` and ``num_images`` (shared), ``instruction`` (the prompt turns), ``output`` (the
    answers of the earlier turns), ``chosen`` and ``rejected`` (the last answers), ``system`` and ``index``.
    """

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = super().__getitem__(index)
        record = self.records[sample["index"]]
        if not isinstance(record, PairRecord):
            raise TypeError(f"{record.where()}: not a preference pair; read the file with a pair format")
        return {**sample, "output": sample["output"][:-1], "chosen": sample["output"][-1],
                "rejected": self._text(record.rejected)}

    def text_sample(self, index: int) -> dict[str, Any]:
        """Both sides' text, for counting a pair's tokens: the longer side stands for the pair."""
        sample = super().text_sample(index)
        record = self.records[index]
        longer = max(sample["output"][-1], self._text(record.rejected), key=len)
        return {**sample, "output": [*sample["output"][:-1], longer]}

    @staticmethod
    def collater(samples) -> dict[str, Any]:
        """One flat ``image`` tensor of every pair's images (each pair's once), the turns and both answers per pair."""
        samples = list(samples)
        batch = InstructionDataset.collater(samples)  # references: the chosen answers, for generation metrics
        return {**batch, "chosen": [s["chosen"] for s in samples], "rejected": [s["rejected"] for s in samples]}

