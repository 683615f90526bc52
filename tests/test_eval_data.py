"""Evaluation data formats: COCO Karpathy test, official COCO captions, LAVIS vqa JSON and the official
VQAv2 questions + annotations pair, through the registered builders, with the training data's bad-record rules.

Records are quoted from the real files: coco_karpathy_test.json (LAVIS/BLIP annotations, as quoted in
X1AOX1A/Demos InstructBLIP/blip2_instruct/README.md) and VQAv2 val question 262148000 (its ten answers as
quoted in public VQAv2 loaders, e.g. evalscope's VQAv2 page); the images here are stand-ins.
"""
from __future__ import annotations

import json
import re

import pytest
from PIL import Image

from lavis_ds.common.registry import registry
from lavis_ds.metrics import build_metric

KARPATHY_TEST = [
    {"image": "val2014/COCO_val2014_000000391895.jpg",
     "caption": ["A man with a red helmet on a small moped on a dirt road. ",
                 "Man riding a motor bike on a dirt road on the countryside.",
                 "A man riding on the back of a motorcycle.",
                 "A dirt path with a young person on a motor bike rests to the foreground of a verdant area with "
                 "a bridge and a background of cloud-wreathed mountains. ",
                 "A man in a red shirt and a red hat is on a motorcycle on a hill side."]},
    {"image": "val2014/COCO_val2014_000000060623.jpg",
     "caption": ["A young girl inhales with the intent of blowing out a candle. ",
                 "A young girl is preparing to blow out her candle.",
                 "A kid is to blow out the single candle in a bowl of birthday goodness. ",
                 "Girl blowing out the candle on an ice-cream ",
                 "A little girl is getting ready to blow out a candle on a small dessert."]},
]
WHERE_ANSWERS = ["down", "down", "at table", "skateboard", "down", "table", "down", "down", "down", "down"]
LAVIS_VQA = [{"question_id": 262148000, "question": "Where is he looking?", "answer": WHERE_ANSWERS,
              "image": "val2014/COCO_val2014_000000262148.jpg", "dataset": "vqa"}]
OFFICIAL_QUESTIONS = {"info": {}, "task_type": "Open-Ended", "data_type": "mscoco", "license": {},
                      "data_subtype": "val2014",
                      "questions": [{"image_id": 262148, "question": "Where is he looking?", "question_id": 262148000}]}
OFFICIAL_ANNOTATIONS = {"info": {}, "license": {}, "data_subtype": "val2014", "annotations": [
    {"question_type": "none of the above", "multiple_choice_answer": "down", "image_id": 262148,
     "answer_type": "other", "question_id": 262148000,
     "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": k + 1} for k, a in enumerate(WHERE_ANSWERS)]}]}


def _image(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), (120, 30, 30)).save(path)


def _json(path, content):
    path.write_text(json.dumps(content))
    return path


def _section(split_files: dict, images, **options):
    small = {"name": "blip2_image_eval", "image_size": 16}
    return {"build_info": {"annotations": split_files, "images": {"storage": str(images)}},
            "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 16}, "eval": small}, **options}


def test_karpathy_test_split_keeps_the_five_captions_of_an_image_on_one_sample(tmp_path):
    for record in KARPATHY_TEST:
        _image(tmp_path / "coco" / record["image"])
    path = _json(tmp_path / "coco_karpathy_test.json", KARPATHY_TEST)
    splits = registry.get_builder_class("coco_caption")(
        _section({"train": {"storage": str(path)}, "test": {"storage": str(path)}}, tmp_path / "coco")).build()
    assert len(splits["train"]) == 10 and len(splits["test"]) == 2  # training: one sample per caption
    sample = splits["test"][0]
    assert sample["references"] == KARPATHY_TEST[0]["caption"] and sample["output"] == ["A man with a red helmet "
                                                                                       "on a small moped on a dirt road."]
    batch = splits["test"].collater([splits["test"][0], splits["test"][1]])
    assert [len(r) for r in batch["references"]] == [5, 5]
    # The references reach the metric together: CIDEr with all five per image.
    scores = build_metric("caption")(["a man riding a motorcycle on a dirt road", "a girl blowing out a candle"],
                                     batch["references"])
    assert scores["CIDEr"] > 0


def test_official_coco_captions_are_grouped_per_image_for_evaluation(tmp_path):
    _image(tmp_path / "val2014" / "COCO_val2014_000000391895.jpg")
    path = _json(tmp_path / "captions_val2014.json", {
        "images": [{"id": 391895, "file_name": "COCO_val2014_000000391895.jpg"}],
        "annotations": [{"image_id": 391895, "id": 770337, "caption": c} for c in KARPATHY_TEST[0]["caption"][:3]]})
    splits = registry.get_builder_class("coco_caption")(
        _section({"train": {"storage": str(path)}, "val": {"storage": str(path)}}, tmp_path / "val2014")).build()
    assert len(splits["train"]) == 3 and len(splits["val"]) == 1
    assert splits["val"][0]["references"] == KARPATHY_TEST[0]["caption"][:3]


@pytest.mark.parametrize("layout", ["lavis", "official"])
def test_vqa_files_give_one_sample_per_question_with_its_ten_answers(tmp_path, layout):
    if layout == "lavis":
        _image(tmp_path / "coco" / "val2014" / "COCO_val2014_000000262148.jpg")
        files = {"storage": str(_json(tmp_path / "vqa_val_eval.json", LAVIS_VQA))}
        images = tmp_path / "coco"
    else:
        _image(tmp_path / "val2014" / "COCO_val2014_000000262148.jpg")
        files = {"storage": str(_json(tmp_path / "v2_OpenEnded_mscoco_val2014_questions.json", OFFICIAL_QUESTIONS)),
                 "answers": str(_json(tmp_path / "v2_mscoco_val2014_annotations.json", OFFICIAL_ANNOTATIONS))}
        images = tmp_path / "val2014"
    splits = registry.get_builder_class("vqa")(_section({"train": files, "val": files}, images)).build()
    val, train = splits["val"][0], splits["train"][0]
    assert val["references"] == WHERE_ANSWERS
    assert val["instruction"] == ["<Img><ImageHere></Img> Where is he looking? Answer the question using a single "
                                  "word or phrase."]
    assert train["output"] == ["down"] and train["references"] == ["down"]  # training: the most frequent answer
    assert build_metric("vqa_accuracy")(["Down"], [val["references"]]) == {"vqa_accuracy": 1.0}


@pytest.mark.parametrize("content, message", [
    ([{"question_id": 1, "question": "Why?", "image": "a.png"}], r"record 0 \(id 1, image 'a\.png'\): missing key\(s\) 'answer'"),
    ([{"question_id": 1, "question": "Why?", "image": "a.png", "answer": []}], r"'answer' must be a string or a non-empty list"),
    ([{"question_id": 1, "question": "", "image": "a.png", "answer": "x"}], r"'question' must be a non-empty string"),
    ([{"question_id": 1, "question": "Why?", "image": "gone.png", "answer": "x"}], r"record 0 \(id 1, image 'gone\.png'\): image file .* not found"),
])
def test_bad_vqa_records_name_file_record_and_problem_or_are_skipped(tmp_path, content, message):
    _image(tmp_path / "a.png")
    good = {"question_id": 2, "question": "What?", "image": "a.png", "answer": ["x"] * 10}
    path = _json(tmp_path / "vqa.json", content + [good])
    builder = registry.get_builder_class("vqa")
    problems = builder(_section({"val": {"storage": str(path)}}, tmp_path)).check()
    assert any(re.search(message, p) for p in problems), problems
    assert any("skip_bad_records: true" in p for p in problems)
    skipping = builder(_section({"val": {"storage": str(path)}}, tmp_path, skip_bad_records=True))
    assert len(skipping.build()["val"]) == 1


def test_official_vqa_pair_problems_are_reported(tmp_path):
    questions = _json(tmp_path / "q.json", OFFICIAL_QUESTIONS)
    builder = registry.get_builder_class("vqa")
    problems = builder(_section({"val": {"storage": str(questions)}}, tmp_path)).check()
    assert any("an official VQA questions file needs its annotations file" in p for p in problems), problems
    wrong = {"storage": [str(questions)], "answers": [str(questions), str(questions)]}
    problems = builder(_section({"val": wrong}, tmp_path)).check()
    assert any("answers: expected one annotations file per questions file" in p for p in problems), problems
    unanswered = dict(OFFICIAL_ANNOTATIONS, annotations=[])
    pair = {"storage": str(questions), "answers": str(_json(tmp_path / "a.json", unanswered))}
    problems = builder(_section({"val": pair}, tmp_path)).check()
    assert any("questions[0] (id 262148000): question_id 262148000 has no entry in" in p for p in problems), problems
