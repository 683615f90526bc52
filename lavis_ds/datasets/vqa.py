"""VQA annotation files -> records: the question as the instruction, the human answers as references.

Two layouts are read by the ``vqa`` builder:

- LAVIS ``vqa`` JSON (``vqav2/annotations/vqa_train.json``, ``vqa_val_eval.json``, OK-VQA's ...):
  ``[{"question_id": 262148000, "question": "Where is he looking?", "answer": ["down", ...],
  "image": "val2014/COCO_val2014_000000262148.jpg"}]`` (``answer`` may be one string); image
  paths are relative to the image root (the COCO folder holding ``val2014/``).
- The official VQAv2 pair: ``v2_OpenEnded_mscoco_val2014_questions.json``
  (``{"data_subtype": "val2014", "questions": [{"image_id", "question", "question_id"}]}``) in
  ``storage`` and ``v2_mscoco_val2014_annotations.json`` (``{"annotations": [{"question_id",
  "answers": [{"answer", "answer_confidence", "answer_id"}], "multiple_choice_answer", ...}]}``)
  at the same position in ``answers``; the image is ``COCO_<data_subtype>_<image_id:012d>.jpg``
  under the image root (the ``val2014/`` folder itself).

Training splits answer with the most frequent human answer (the official
``multiple_choice_answer`` where given); evaluation splits keep all human answers
as the references of one sample, which ``vqa_accuracy`` scores.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

from lavis_ds.common import registry as reg
from lavis_ds.datasets.builders import BaseDatasetBuilder, local_path, path_list
from lavis_ds.datasets.loading import ParseFile, RecordLoader, read_json
from lavis_ds.datasets.options import SectionOptions
from lavis_ds.datasets.processor_sections import processor_stage
from lavis_ds.datasets.records import IMAGE_PLACEHOLDER, BadRecord, InstructionRecord, record_where

# LLaVA-1.5's short-answer VQAv2 prompt; `{question}` is replaced by the record's question.
DEFAULT_VQA_PROMPT = "{question} Answer the question using a single word or phrase."


def vqa_instruction(prompt: str, question: str) -> str:
    return f"{IMAGE_PLACEHOLDER} {prompt.replace('{question}', question.strip())}"


@dataclasses.dataclass(frozen=True)
class VqaOptions(SectionOptions):
    """Plus ``prompt``: the instruction, with ``{question}`` where the question goes (the image in front)."""

    prompt: str = DEFAULT_VQA_PROMPT

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.prompt, str) or self.prompt.count("{question}") != 1:
            raise ValueError(f"prompt: must contain '{{question}}' exactly once, got {self.prompt!r}")


def parse_vqa_file(raw: Any, source: Path, *, prompt: str = DEFAULT_VQA_PROMPT, group_references: bool = True,
                   answers_files: Mapping[Path, Path] | None = None) -> Iterator[InstructionRecord | BadRecord]:
    """Either VQA layout as a :data:`~lavis_ds.datasets.loading.ParseFile` (bind the options first).

    ``answers_files`` maps an official questions file to its annotations file.
    """
    if isinstance(raw, list):
        return _lavis(raw, source, prompt, group_references)
    if isinstance(raw, dict) and isinstance(raw.get("questions"), list):
        answers = (answers_files or {}).get(Path(source))
        if answers is None:
            raise ValueError(f"{source}: an official VQA questions file needs its annotations file "
                             f"(v2_mscoco_*_annotations.json) at the same position under `answers:`")
        return _official(raw, source, read_json(answers), answers, prompt, group_references)
    if isinstance(raw, dict) and "annotations" in raw:
        raise ValueError(f"{source}: an official VQA annotations file goes under `answers:`, beside its "
                         f"questions file under `storage:`")
    found = f"an object with keys {sorted(raw)}" if isinstance(raw, dict) else f"a {type(raw).__name__}"
    raise ValueError(f"{source}: expected a LAVIS vqa list of {{question_id, question, answer, image}} records or "
                     f"an official VQA questions file (an object with 'questions'), got {found}")


def _most_frequent(answers: tuple[str, ...]) -> str:
    counts = collections.Counter(answers)
    return max(answers, key=lambda a: counts[a])  # ties: the first given, as max() keeps the first


def _record(image: str, question: str, answers: tuple[str, ...], best: str, prompt: str, group: bool,
            source: Path, position: int, record_id: Any, list_name: str | None = None) -> InstructionRecord:
    return InstructionRecord((image,), (vqa_instruction(prompt, question),), (best,), source, position,
                             record_id=record_id, list_name=list_name, references=answers if group else None)


def _lavis(raw: list, source: Path, prompt: str, group: bool) -> Iterator[InstructionRecord | BadRecord]:
    for position, item in enumerate(raw):
        record_id = item.get("question_id") if isinstance(item, dict) else None
        image = item.get("image") if isinstance(item, dict) else None
        where = record_where(source, position, record_id=record_id, image=image if isinstance(image, str) else None)
        if not isinstance(item, dict):
            yield BadRecord(where, f"expected an object with keys question_id, question, answer, image; "
                                   f"got {type(item).__name__}")
            continue
        missing = [key for key in ("question", "answer", "image") if key not in item]
        if missing:
            yield BadRecord(where, f"missing key(s) {', '.join(map(repr, missing))} (record has {sorted(item)})")
            continue
        try:
            answers = _answers(item["answer"], where)
            question = _text(item["question"], where, "question")
            if not isinstance(image, str) or not image:
                raise BadRecord(where, f"'image' must be a non-empty string (a path under the image root), "
                                       f"got {image!r}")
        except BadRecord as bad:
            yield bad
            continue
        yield _record(image, question, answers, _most_frequent(answers), prompt, group, source, position, record_id)


def _official(questions: dict, source: Path, annotations: Any, answers_path: Path, prompt: str,
              group: bool) -> Iterator[InstructionRecord | BadRecord]:
    if not isinstance(annotations, dict) or not isinstance(annotations.get("annotations"), list):
        raise ValueError(f"{answers_path}: expected an official VQA annotations file (an object with a list "
                         f"'annotations'), the partner of {source}")
    subtype = questions.get("data_subtype")
    if not isinstance(subtype, str) or not subtype:
        raise ValueError(f"{source}: 'data_subtype' (e.g. 'val2014') is missing; it names the image files "
                         f"(COCO_<data_subtype>_<image_id>.jpg)")
    by_question = {}
    for ann in annotations["annotations"]:
        if isinstance(ann, dict) and "question_id" in ann:
            by_question[ann["question_id"]] = ann
    for position, q in enumerate(questions["questions"]):
        record_id = q.get("question_id") if isinstance(q, dict) else None
        where = record_where(source, position, list_name="questions", record_id=record_id)
        try:
            if not isinstance(q, dict) or not isinstance(q.get("image_id"), int):
                raise BadRecord(where, f"a question needs an integer 'image_id', a 'question' and a 'question_id', "
                                       f"got {q!r}")
            question = _text(q.get("question"), where, "question")
            ann = by_question.get(record_id)
            if ann is None:
                raise BadRecord(where, f"question_id {record_id!r} has no entry in {answers_path}")
            raw_answers = ann.get("answers")
            if not isinstance(raw_answers, list) or not all(isinstance(a, dict) for a in raw_answers):
                raise BadRecord(where, f"its annotation in {answers_path} needs 'answers': a list of "
                                       f"{{answer, answer_id}} objects, got {raw_answers!r}")
            answers = _answers([a.get("answer") for a in raw_answers], where)
        except BadRecord as bad:
            yield bad
            continue
        best = ann.get("multiple_choice_answer")
        best = best if isinstance(best, str) and best.strip() else _most_frequent(answers)
        image = f"COCO_{subtype}_{q['image_id']:012d}.jpg"
        yield _record(image, question, answers, best, prompt, group, source, position, record_id, "questions")


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRecord(where, f"{key!r} must be a non-empty string, got {value!r}")
    return value


def _answers(value: Any, where: str) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise BadRecord(where, f"'answer' must be a string or a non-empty list of strings, got {value!r}")
    for k, answer in enumerate(values):
        if not isinstance(answer, str) or not answer.strip():
            raise BadRecord(where, f"answer {k} must be a non-empty string, got {answer!r}")
    return tuple(values)


@reg.builders.register("vqa")
class VqaBuilder(BaseDatasetBuilder):
    """VQA questions with human answers (LAVIS ``vqa`` JSON, or the official VQAv2 questions + annotations
    pair: ``annotations.<split>: {storage: questions.json, answers: annotations.json}``)."""

    OPTIONS = VqaOptions
    ANNOTATION_SPLIT_KEYS: ClassVar[tuple[str, ...]] = ("storage", "answers")

    def answers_files(self) -> dict[Path, Path]:
        """Official questions file -> its annotations file, by position in each split's lists."""
        pairs = {}
        for entry in (self.build_info.get("annotations") or {}).values():
            if isinstance(entry, dict) and "answers" in entry:
                questions, answers = path_list(entry.get("storage")) or [], path_list(entry.get("answers")) or []
                pairs.update({local_path(q): local_path(a) for q, a in zip(questions, answers)})
        return pairs

    def check(self) -> list[str]:
        problems = []
        for split, entry in (self.build_info.get("annotations") or {}).items():
            if isinstance(entry, dict) and "answers" in entry:
                storage, answers = path_list(entry.get("storage")), path_list(entry.get("answers"))
                if answers is None or storage is None or len(answers) != len(storage):
                    problems.append(f"{self.where}.build_info.annotations.{split}.answers: expected one "
                                    f"annotations file per questions file in `storage` (same order), got "
                                    f"{entry.get('answers')!r} for {entry.get('storage')!r}")
        return problems + super().check()

    def _parser(self, group: bool) -> ParseFile:
        return functools.partial(parse_vqa_file, prompt=self.options().prompt, group_references=group,
                                 answers_files=self.answers_files())

    def parse_file(self) -> ParseFile:
        return self._parser(group=False)

    @functools.cached_property
    def eval_loader(self) -> RecordLoader:
        """Evaluation splits: every human answer of a question on its one sample (vqa_accuracy needs all ten)."""
        return RecordLoader(self._parser(group=True), skip=self.options().skipped_kinds(),
                            parsed_files=self.parsed_files)

    def loader_for(self, split: str) -> RecordLoader:
        return self.loader if processor_stage(split) == "train" else self.eval_loader
