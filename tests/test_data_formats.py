"""LLaVA conversation and COCO-caption JSON, and bad records (mixing datasets: test_dataset_mixing.py).

Everything runs on real files: JSON written to tmp_path and PNG/JPEG images made with PIL.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from PIL import Image
from torch.utils.data import DataLoader

from lavis_ds.config import ConfigError, load_config
from lavis_ds.datasets import (
    IMAGE_PLACEHOLDER,
    BadRecordsError,
    CocoCaptionBuilder,
    InstructionDataset,
    LlavaConversationBuilder,
    RecordLoader,
    UnreadableImageError,
)
from lavis_ds.datasets.coco_caption import DEFAULT_CAPTION_PROMPT, parse_coco_caption_file
from lavis_ds.datasets.llava import parse_llava_file
from lavis_ds.datasets.loading import ALL_KINDS
from lavis_ds.datasets.records import BadRecord
from lavis_ds.models.prompt import insert_image_placeholders
from lavis_ds.processors import Blip2ImageEvalProcessor
from run_utils import write_yaml

EVAL_16 = {"train": {"name": "blip2_image_eval", "image_size": 16}, "eval": {"name": "blip2_image_eval", "image_size": 16}}


def _image(path: Path, colour=(200, 30, 30), size=(24, 18)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)  # PNG or JPEG by the suffix
    return path


def _json(path: Path, content) -> Path:
    path.write_text(json.dumps(content))
    return path


def _section(annotation: Path, images: Path, **options) -> dict:
    return {"build_info": {"annotations": {"train": {"storage": str(annotation)}}, "images": {"storage": str(images)}},
            "vis_processor": EVAL_16, **options}


def _human(text):
    return {"from": "human", "value": text}


def _gpt(text):
    return {"from": "gpt", "value": text}


# ---- LLaVA conversation JSON ----------------------------------------------------------------------

@pytest.fixture
def llava_files(tmp_path):
    root = tmp_path / "llava"
    _image(root / "coco/train2017/000000033471.jpg")
    _image(root / "coco/train2017/000000052846.jpg", colour=(10, 200, 10))
    _image(root / "gqa/images/2354786.jpg", colour=(10, 10, 200))
    records = [
        {"id": "000000033471", "image": "coco/train2017/000000033471.jpg", "conversations": [
            _human("<image>\nWhat are the colors of the bus in the image?"), _gpt("The bus is white and red."),
            _human("What feature can be seen on the back of the bus?"), _gpt("An advertisement."),
        ]},
        # <image> after the question (LLaVA-Instruct has both orders): the image goes in front, as in LLaVA.
        {"id": "000000052846", "image": "coco/train2017/000000052846.jpg", "conversations": [
            _human("Where is the cat?\n<image>"), _gpt("On the sofa."),
        ]},
        # No <image> at all, and an opening gpt turn (LLaVA's train.py drops it).
        {"id": 2354786, "image": "gqa/images/2354786.jpg", "conversations": [
            _gpt("Hello."), _human("Is the sky blue?"), _gpt("Yes."),
        ]},
    ]
    return root, _json(tmp_path / "llava.json", records)


def test_llava_records_become_instruction_turns_with_the_image_placeholder(llava_files):
    root, path = llava_files
    dataset = InstructionDataset(path, root, Blip2ImageEvalProcessor(image_size=16),
                                 loader=RecordLoader(parse_llava_file))
    assert len(dataset) == 3
    first = dataset[0]
    assert first["instruction"] == [f"{IMAGE_PLACEHOLDER} What are the colors of the bus in the image?",
                                    "What feature can be seen on the back of the bus?"]
    assert first["output"] == ["The bus is white and red.", "An advertisement."]
    assert first["image"].shape == (1, 3, 16, 16)
    assert dataset[1]["instruction"] == [f"{IMAGE_PLACEHOLDER} Where is the cat?"]
    assert dataset[2]["instruction"] == [f"{IMAGE_PLACEHOLDER} Is the sky blue?"] and dataset[2]["output"] == ["Yes."]
    # The image really is the record's: green for record 1 (channel means differ from record 0's red).
    assert dataset[1]["image"][0, 1].mean() > dataset[1]["image"][0, 0].mean()
    assert dataset[0]["image"][0, 0].mean() > dataset[0]["image"][0, 1].mean()
    # Every converted sample is one the ChatML prompt accepts (exactly one image marker).
    for i in range(len(dataset)):
        turns = insert_image_placeholders(dataset[i]["instruction"], "<|image_pad|>", 4)
        assert sum(t.count("<|image_pad|>") for t in turns) == 4


def test_llava_builder_builds_from_its_section(llava_files):
    root, path = llava_files
    builder = LlavaConversationBuilder(_section(path, root))
    assert builder.check() == []
    train = builder.build()["train"]
    assert len(train) == 3 and train[0]["image"].shape == (1, 3, 16, 16)
    assert train.records[2].where() == f"{path}: record 2 (id 2354786, image 'gqa/images/2354786.jpg')"


LLAVA_BAD = [
    ({"id": "b", "image": "a.jpg"}, r"missing key 'conversations'"),
    ({"id": "b", "image": "a.jpg", "conversations": "What?"}, r"'conversations' must be a list .* got str"),
    ({"id": "b", "image": "a.jpg", "conversations": []}, r"'conversations' is empty"),
    ({"id": "b", "image": "a.jpg", "conversations": [_human("<image>\nA?"), _human("B?")]},
     r"conversations\[1\] is from 'human' but a 'gpt' turn must come there"),
    ({"id": "b", "image": "a.jpg", "conversations": [_human("<image>\nA?"), _gpt("a"), _human("B?")]},
     r"conversations\[2\] is a 'human' turn with no 'gpt' answer"),
    ({"id": "b", "image": "a.jpg", "conversations": [_human("<image>\nA?"), {"from": "bot", "value": "a"}]},
     r"conversations\[1\]\.from is 'bot'; valid: 'human', 'gpt'"),
    ({"id": "b", "image": "a.jpg", "conversations": [_human("<image>\nA?"), {"from": "gpt", "value": 3}]},
     r"conversations\[1\]\.value must be a string, got int"),
    ({"id": "b", "image": "a.jpg", "conversations": [_human("<image>\nA?"), _gpt("  ")]},
     r"conversations\[1\] \('gpt'\) is empty"),
    ({"id": "b", "image": "a.jpg", "conversations": [_human("<image> A <image>?"), _gpt("a")]},
     r"'<image>' appears 2 time\(s\) \(in conversations\[0\]\) but the record has 1 image\(s\) in 'image': "
     r"valid is one '<image>' per image"),
    ({"id": "b", "image": "a.jpg", "conversations": [_human("A?"), _gpt("<image> a")]},
     r"conversations\[1\] is a 'gpt' turn with '<image>'"),
    ({"id": "b", "image": ["a.jpg", "a.jpg"], "conversations": [_human("<image> A?"), _gpt("a")]},
     r"'<image>' appears 1 time\(s\).*but the record has 2 image\(s\)"),
    ({"id": "b", "conversations": [_human("<image> A?"), _gpt("a")]},
     r"'<image>' appears 1 time\(s\).*but the record has no 'image' key \(a text-only record\)"),
    ({"id": "b", "image": [], "conversations": [_human("A?"), _gpt("a")]},
     r"'image' must be a non-empty string or a non-empty list"),
    ({"id": "b", "image": "not_there.jpg", "conversations": [_human("<image>\nA?"), _gpt("a")]},
     r"image file .*not_there\.jpg not found"),
]


@pytest.mark.parametrize("record, problem", LLAVA_BAD, ids=[p for _, p in LLAVA_BAD])
def test_each_bad_llava_record_names_file_record_and_problem_at_load_time(tmp_path, record, problem):
    _image(tmp_path / "a.jpg")
    good = {"id": "g", "image": "a.jpg", "conversations": [_human("<image>\nQ?"), _gpt("A.")]}
    path = _json(tmp_path / "llava.json", [good, record])
    with pytest.raises(BadRecordsError, match=rf"llava\.json: record 1 \(id 'b'.*{problem}"):
        InstructionDataset(path, tmp_path, Blip2ImageEvalProcessor(), loader=RecordLoader(parse_llava_file))


def test_text_only_llava_records_are_skipped_and_counted_with_skip_text_only(tmp_path, caplog):
    _image(tmp_path / "a.jpg")
    records = [{"id": i, "image": "a.jpg", "conversations": [_human("<image>\nQ?"), _gpt("A.")]} for i in range(3)]
    records.insert(1, {"id": "sharegpt", "conversations": [_human("Hi"), _gpt("Hello")]})
    path = _json(tmp_path / "mix.json", records)
    builder = LlavaConversationBuilder(_section(path, tmp_path, skip_text_only=True), section_name="llava")
    assert builder.check() == []
    with caplog.at_level(logging.WARNING):
        train = builder.build()["train"]
    assert len(train) == 3 and [b.kind for b in train.skipped] == [BadRecord.TEXT_ONLY]
    assert "skipped 1 of 4 record(s) (1 text only)" in caplog.text and "record 1 (id 'sharegpt')" in caplog.text
    # skip_text_only covers text-only records only: a malformed one is still an error.
    _json(path, records + [{"id": "bad", "image": "a.jpg", "conversations": []}])
    problems = LlavaConversationBuilder(_section(path, tmp_path, skip_text_only=True), section_name="llava").check()
    assert any("record 4 (id 'bad', image 'a.jpg'): 'conversations' is empty" in p for p in problems), problems


# ---- COCO-caption JSON ----------------------------------------------------------------------------

def test_karpathy_lists_train_one_sample_per_caption_and_evaluate_one_per_image(tmp_path):
    root = tmp_path / "coco"
    _image(root / "val2014/COCO_val2014_000000391895.jpg")
    _image(root / "val2014/COCO_val2014_000000522418.jpg")
    train = _json(tmp_path / "coco_karpathy_train.json", [
        {"image": "val2014/COCO_val2014_000000522418.jpg", "caption": "A woman cutting a cake. ",
         "image_id": "coco_522418"}])
    val = _json(tmp_path / "coco_karpathy_val.json", [
        {"image": "val2014/COCO_val2014_000000391895.jpg", "caption": ["A man on a bike.", "A biker on a road."]}])
    section = _section(train, root)
    section["build_info"]["annotations"]["val"] = {"storage": str(val)}
    splits = CocoCaptionBuilder(section).build()
    assert len(splits["train"]) == 1 and len(splits["val"]) == 1
    sample = splits["train"][0]
    assert sample["instruction"] == [f"{IMAGE_PLACEHOLDER} {DEFAULT_CAPTION_PROMPT}"]
    assert sample["output"] == ["A woman cutting a cake."]  # the default plain_text processor strips
    assert sample["image"].shape == (1, 3, 16, 16)
    # Evaluation keeps the references of an image together (scored against all of them; loss on the first).
    assert splits["val"][0]["output"] == ["A man on a bike."]
    assert splits["val"][0]["references"] == ["A man on a bike.", "A biker on a road."]


def test_official_coco_captions_file_and_a_custom_prompt(tmp_path):
    root = tmp_path / "train2017"
    _image(root / "000000391895.jpg")
    _image(root / "000000522418.png")
    path = _json(tmp_path / "captions_train2017.json", {
        "info": {}, "licenses": [],
        "images": [{"id": 391895, "file_name": "000000391895.jpg", "width": 24, "height": 18},
                   {"id": 522418, "file_name": "000000522418.png", "width": 24, "height": 18}],
        "annotations": [{"image_id": 522418, "id": 7, "caption": "A woman cutting a cake."},
                        {"image_id": 391895, "id": 9, "caption": "A man riding a bike."}],
    })
    builder = CocoCaptionBuilder(_section(path, root, prompt=f"Caption: {IMAGE_PLACEHOLDER} (short)"))
    train = builder.build()["train"]
    assert [train[i]["output"] for i in range(2)] == [["A woman cutting a cake."], ["A man riding a bike."]]
    assert train[0]["instruction"] == [f"Caption: {IMAGE_PLACEHOLDER} (short)"]
    assert train.image_name(1) == "000000391895.jpg"
    assert train.records[0].where() == f"{path}: annotations[0] (id 7, image '000000522418.png')"


COCO_BAD = [
    ([{"image": "a.png"}], r"coco\.json: record 0 \(image 'a\.png'\): missing key\(s\) 'caption'"),
    ([{"image": "a.png", "caption": 5}], r"record 0 \(image 'a\.png'\): 'caption' must be a string, got int"),
    ([{"image": "a.png", "caption": []}], r"record 0 \(image 'a\.png'\): 'caption' is an empty list"),
    ([{"image": "a.png", "caption": ["ok", ""]}], r"record 0 \(image 'a\.png'\): 'caption\[1\]' is empty"),
    ([{"image": 3, "caption": "x"}], r"record 0: 'image' must be a non-empty string"),
    ([{"image": "gone.png", "caption": "x", "image_id": 4}], r"record 0 \(id 4, image 'gone\.png'\): image file .* not found"),
    ({"images": [{"id": 1, "file_name": "a.png"}], "annotations": [{"image_id": 2, "id": 5, "caption": "x"}]},
     r"coco\.json: annotations\[0\] \(id 5\): image_id 2 is not among the file's 'images'"),
    ({"images": [{"id": 1}], "annotations": []}, r"coco\.json: images\[0\]: an image entry needs an 'id'"),
]


@pytest.mark.parametrize("content, message", COCO_BAD, ids=[m for _, m in COCO_BAD])
def test_each_bad_coco_record_names_file_record_and_problem(tmp_path, content, message):
    _image(tmp_path / "a.png")
    path = _json(tmp_path / "coco.json", content)
    with pytest.raises(BadRecordsError, match=message):
        InstructionDataset(path, tmp_path, Blip2ImageEvalProcessor(), loader=RecordLoader(parse_coco_caption_file))


def test_a_file_of_the_wrong_layout_names_the_file_and_both_layouts(tmp_path):
    path = _json(tmp_path / "coco.json", {"captions": []})
    with pytest.raises(ValueError, match=r"coco\.json: expected a list of \{image, caption\} records .* or an "
                                         r"official COCO captions file .* got an object with keys \['captions'\]"):
        InstructionDataset(path, tmp_path, Blip2ImageEvalProcessor(), loader=RecordLoader(parse_coco_caption_file))


# ---- bad records through the config: reported before training, or skipped and counted -------------

def _run_yaml(tmp_path, tokenizer_dir, datasets: dict) -> Path:
    for section in datasets.values():  # images the size the model below takes, unless a test says otherwise
        section.setdefault("vis_processor", EVAL_16)
    cfg = {"model": {"arch": "blip2_qwen", "model_type": "tiny", "tokenizer": str(tokenizer_dir), "image_size": 16},
           "datasets": datasets,
           "run": {"output_dir": str(tmp_path / "out"),
                   "batch_size_train": 1, "zero_stage": 0}}
    return write_yaml(tmp_path / "run.yaml", cfg)


def test_load_config_reports_bad_records_with_file_record_and_the_skip_key(tmp_path, tiny_tokenizer_dir):
    _image(tmp_path / "images/a.png")
    records = [{"image": "a.png", "caption": "ok"}, {"image": "missing.png", "caption": "x"}, {"image": "a.png"}]
    ann = _json(tmp_path / "coco.json", records)
    section = {"builder": "coco_caption", "build_info": {"annotations": {"train": {"storage": str(ann)}},
                                                         "images": {"storage": str(tmp_path / "images")}}}
    with pytest.raises(ConfigError) as info:
        load_config(_run_yaml(tmp_path, tiny_tokenizer_dir, {"captions": section}))
    key = "datasets.captions.build_info.annotations.train.storage"
    assert info.value.problems == [
        f"{key}: {ann}: record 1 (image 'missing.png'): image file {tmp_path / 'images/missing.png'} not found "
        f"(image root {tmp_path / 'images'})",
        f"{key}: {ann}: record 2 (image 'a.png'): missing key(s) 'caption' (record has ['image'])",
        f"{key}: 2 bad record(s); fix them, or set datasets.captions.skip_bad_records: true to skip such records "
        f"(counted in the log)",
    ]
    # With the switch the same config loads, and the build skips both records with one warning.
    section["skip_bad_records"] = True
    cfg = load_config(_run_yaml(tmp_path, tiny_tokenizer_dir, {"captions": section}))
    builder = CocoCaptionBuilder(cfg.datasets.captions)
    assert len(builder.build()["train"]) == 1


def test_skip_mode_warns_once_with_the_count_and_the_first_examples(tmp_path, caplog):
    _image(tmp_path / "a.png")
    records = [{"image": "a.png", "caption": "ok"}] + [{"image": "a.png", "caption": i} for i in range(8)]
    ann = _json(tmp_path / "coco.json", records)
    with caplog.at_level(logging.WARNING):
        train = CocoCaptionBuilder(_section(ann, tmp_path, skip_bad_records=True), section_name="c").build()["train"]
    assert len(train) == 1 and len(train.skipped) == 8
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message.startswith("datasets.c.build_info.annotations.train.storage: skipped 8 of 9 record(s) (8 malformed)")
    assert "record 1 (image 'a.png'): 'caption' must be a string, got int: 0" in message
    assert "... and 3 more" in message  # the first five are quoted, the rest counted


def test_every_record_bad_is_an_error_even_in_skip_mode(tmp_path):
    ann = _json(tmp_path / "coco.json", [{"image": "gone.png", "caption": "x"}])
    problems = CocoCaptionBuilder(_section(ann, tmp_path, skip_bad_records=True)).check()
    assert len(problems) == 1 and "no usable record (all 1 were skipped as bad)" in problems[0]


# ---- images that do not decode: found when the sample is loaded ------------------------------------

@pytest.fixture
def corrupt_files(tmp_path):
    root = tmp_path / "images"
    _image(root / "good0.jpg")
    good = _image(root / "good2.jpg", colour=(0, 0, 250)).read_bytes()
    (root / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "garbage.png").write_bytes(b"this is not a picture" * 20)
    _image(root / "good4.png", colour=(0, 250, 0))
    ann = _json(tmp_path / "coco.json", [{"image": name, "caption": f"caption {i}", "image_id": i} for i, name in
                                         enumerate(["good0.jpg", "truncated.jpg", "good2.jpg", "garbage.png",
                                                    "good4.png"])])
    return root, ann


def test_a_corrupt_image_gives_an_error_naming_the_image_and_the_record(corrupt_files):
    root, ann = corrupt_files
    train = CocoCaptionBuilder(_section(ann, root)).build()["train"]  # existence is all the load checks
    assert len(train) == 5 and train[0]["image"].shape == (1, 3, 16, 16)
    with pytest.raises(UnreadableImageError, match=r"coco\.json: record 1 \(id 1, image 'truncated\.jpg'\): "
                                                   r"cannot read image file .*truncated\.jpg: OSError"):
        train[1]
    with pytest.raises(UnreadableImageError, match=r"record 3 \(id 3, image 'garbage\.png'\): cannot read image "
                                                   r"file .*garbage\.png: UnidentifiedImageError"):
        train[3]
    # From a DataLoader worker, the message reaching the main process still names image and record.
    batches = iter(DataLoader(train, batch_size=1, num_workers=1, collate_fn=train.collater))
    with pytest.raises(UnreadableImageError, match=r"record 1 \(id 1, image 'truncated\.jpg'\): cannot read image"):
        list(batches)
    # Its worker stopped now, as the iterator's __del__ does: the traceback keeps the iterator until a later garbage
    # collection, which frees its queues first and so waits 5 s for the worker (in whatever test runs then).
    batches._shutdown_workers()


def test_skip_mode_replaces_a_corrupt_image_by_the_next_readable_record_and_counts_it(corrupt_files, caplog):
    root, ann = corrupt_files
    train = CocoCaptionBuilder(_section(ann, root, skip_bad_records=True)).build()["train"]
    with caplog.at_level(logging.WARNING):
        samples = [train[i] for i in range(5)]
    assert [s["index"] for s in samples] == [0, 2, 2, 4, 4]
    assert [s["output"] for s in samples][1] == ["caption 2"]
    assert train.replaced_images == 2
    assert len(caplog.records) == 2 and "truncated.jpg" in caplog.text and "garbage.png" in caplog.text
    assert "sample 3 replaced by record 4 (2 unreadable image(s) replaced so far in this process)" in caplog.text
    assert [train[1]["index"] for _ in range(3)] == [2, 2, 2]  # deterministic


# ---- config validation of the new keys ------------------------------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("sample_ratoi", 2, r"datasets\.llava\.sample_ratoi: unknown key; did you mean 'sample_ratio'\?"),
    ("skip_bad_record", True, r"datasets\.llava\.skip_bad_record: unknown key; did you mean 'skip_bad_records'\?"),
    ("sample_ratio", "lots", r"datasets\.llava\.sample_ratio: expected float \| null, got 'lots'"),
    ("sample_ratio", -1, r"datasets\.llava\.sample_ratio: must be a positive number, got -1"),
    ("skip_text_only", "yes", r"datasets\.llava\.skip_text_only: expected bool, got 'yes'"),
    ("prompt", "x", r"datasets\.llava\.prompt: unknown key; valid keys: .*skip_text_only"),
])
def test_bad_option_values_are_config_errors(tmp_path, tiny_tokenizer_dir, llava_files, key, value, message):
    root, path = llava_files
    section = {"builder": "llava_conversation", key: value, **_section(path, root)}
    with pytest.raises(ConfigError) as info:
        load_config(_run_yaml(tmp_path, tiny_tokenizer_dir, {"llava": section}))
    assert len(info.value.problems) == 1 and re.search(message, info.value.problems[0]), info.value.problems


def test_coco_prompt_with_two_images_is_a_config_error(tmp_path, tiny_tokenizer_dir, llava_files):
    root, path = llava_files
    section = {"builder": "coco_caption", "prompt": f"{IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}",
               **_section(path, root)}
    with pytest.raises(ConfigError, match=r"datasets\.coco\.prompt: '<ImageHere>' appears 2 times"):
        load_config(_run_yaml(tmp_path, tiny_tokenizer_dir, {"coco": section}))


def test_sample_ratio_on_some_training_datasets_only_is_a_config_error(tmp_path, tiny_tokenizer_dir, llava_files):
    root, path = llava_files
    datasets = {"a": {"builder": "llava_conversation", "sample_ratio": 2, **_section(path, root)},
                "b": {"builder": "llava_conversation", **_section(path, root)}}
    with pytest.raises(ConfigError) as info:
        load_config(_run_yaml(tmp_path, tiny_tokenizer_dir, datasets))
    assert info.value.problems == ["datasets.b.sample_ratio: missing; datasets a set sample_ratio, and the ratios "
                                   "only make sense when every training dataset has one"]


def test_training_datasets_with_different_image_sizes_are_a_config_error(tmp_path, tiny_tokenizer_dir, llava_files):
    root, path = llava_files
    big = {"train": {"name": "blip2_image_train", "image_size": 32}, "eval": EVAL_16["eval"]}
    datasets = {"a": {"builder": "llava_conversation", **_section(path, root)},
                "b": {"builder": "coco_caption", **_section(path, root), "vis_processor": big}}
    with pytest.raises(ConfigError) as info:
        load_config(_run_yaml(tmp_path, tiny_tokenizer_dir, datasets))
    assert info.value.problems == [
        "datasets.b.vis_processor.train.image_size: 32 differs from datasets.a's 16; "
        "datasets that train together must make images of one size (a batch mixes them)",
        "datasets.b.vis_processor.train.image_size: 32 but model.image_size is 16; "
        "the vision tower takes images of model.image_size only"]


def test_every_kind_of_bad_record_is_covered_by_skip_bad_records():
    from lavis_ds.datasets.options import CocoCaptionOptions, LlavaOptions

    assert LlavaOptions(skip_bad_records=True).skipped_kinds() == ALL_KINDS
    assert LlavaOptions(skip_text_only=True).skipped_kinds() == {BadRecord.TEXT_ONLY}
    assert CocoCaptionOptions().skipped_kinds() == frozenset()


# ---- chat records with roles (LLaMA-Factory sharegpt, ms-swift messages): their own system turns ---------------
CHAT_FIXTURES = Path(__file__).parent / "fixtures" / "chat_messages"


def _chat_records(name: str, image_root: Path) -> list:
    from lavis_ds.datasets.messages import parse_messages_file

    return list(RecordLoader(parse_messages_file).load([CHAT_FIXTURES / name], image_root).records)


def test_quoted_chat_records_load_with_their_own_system_turns(tmp_path):
    weather, math = _chat_records("swift_sft_en.jsonl", tmp_path)
    assert (weather.system, weather.instructions, weather.outputs, weather.images) == (
        "You are a useful and harmless assistant", ("Tell me tomorrow's weather",),
        ("Tomorrow's weather will be sunny",), ())
    assert math.system == "You are a useful and harmless math calculator" and math.outputs == ("It equals 2",
                                                                                               "It equals 3")
    zh_weather, zh_math = _chat_records("swift_sft_zh.jsonl", tmp_path)
    assert (zh_weather.system, zh_math.system, zh_math.instructions) == (
        "你是个有用无害的助手", "你是个有用无害的数学计算器", ("1+1等于几", "再加1呢"))
    (shoes,) = _chat_records("llamafactory_sharegpt_system_column.json", tmp_path)
    assert shoes.system == "你是一个非常聪明的AI助手，非常擅长按照指示行事。尽你所能地帮助。"
    assert shoes.outputs == ("每个房间里的展品都共享相同的主题。",)
    for name in ("mllm_demo_data/1.jpg", "mllm_demo_data/2.jpg"):
        _image(tmp_path / name)
    two_images, one_image = _chat_records("llamafactory_mllm_demo.json", tmp_path)
    assert two_images.system is None and two_images.images == ("mllm_demo_data/1.jpg",) * 2
    assert two_images.instructions == (f"{IMAGE_PLACEHOLDER} Who are they?",
                                       f"{IMAGE_PLACEHOLDER} What are they doing?")
    assert one_image.instructions == (f"{IMAGE_PLACEHOLDER} Who is he?", "Why is he on the ground?")


def test_a_chat_section_serves_each_samples_system_turn(tmp_path):
    from lavis_ds.common import registry as reg

    section = {"builder": "chat_messages", "vis_processor": EVAL_16, "build_info": {
        "annotations": {"train": {"storage": str(CHAT_FIXTURES / "swift_sft_en.jsonl")}},
        "images": {"storage": str(tmp_path)}}}
    train = reg.builders.get("chat_messages")(section).build()["train"]
    batch = train.collater([train[1], train[0]])
    assert batch["system"] == ["You are a useful and harmless math calculator",
                               "You are a useful and harmless assistant"]
    assert batch["num_images"] == [0, 0] and batch["image"].shape[0] == 0
    assert train.text_sample(0)["system"] == "You are a useful and harmless assistant"  # counted by token budgets


CHAT_BAD = [
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"},
                   {"role": "assistant", "content": "A"}]},
     r"record 0: messages\[1\] is a system turn but not the first turn: the system prompt opens the conversation "
     r"\(move it to messages\[0\]\)"),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "system", "content": "T"},
                   {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
     r"record 0: messages\[0\] and messages\[1\] are both system turns: a conversation has one system prompt, its "
     r"first turn; join their texts into it"),
    ({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                        {"from": "gpt", "value": "A"}], "system": "T"},
     r"record 0: has a 'system' column \('T'\) and a system turn in 'conversations' \('S'\): give the system "
     r"prompt once"),
    ({"messages": [{"role": "user", "content": "Q"}], "system": 3},
     r"record 0: 'system' must be a string \(the record's system prompt\), got 3"),
    ({"messages": [{"role": "tool", "content": "Q"}]}, r"record 0: messages\[0\] has role 'tool'; valid: human, user"),
    ({"instruction": "Q", "output": "A"}, r"record 0: missing 'messages' \(or 'conversations'\)"),
    ({"messages": [{"role": "system", "content": "S"}]},
     r"record 0: 'messages' holds only a system turn: a record needs a user turn and its answer"),
]


@pytest.mark.parametrize("record, message", CHAT_BAD, ids=["system-not-first", "two-system-turns",
                                                          "system-column-and-turn", "system-not-text", "role",
                                                          "no-turns", "only-system"])
def test_each_bad_chat_record_is_named_with_what_would_be_valid(tmp_path, record, message):
    from lavis_ds.datasets.messages import parse_messages_file

    path = tmp_path / "chat.json"
    path.write_text(json.dumps([record]))
    with pytest.raises(BadRecordsError, match=message):
        RecordLoader(parse_messages_file).load([path], tmp_path)
