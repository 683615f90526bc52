"""Preference pairs: the published formats load (tests/fixtures/preference/SOURCES.md), bad pairs are named, and a
pair batch carries each pair's image once."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

import lavis_ds  # noqa: F401
from lavis_ds.datasets.builders import PreferencePairsBuilder
from lavis_ds.datasets.loading import BadRecordsError, RecordLoader
from lavis_ds.datasets.preference import PairDataset, pair_parser
from lavis_ds.datasets.record_store import pack
from lavis_ds.datasets.records import IMAGE_PLACEHOLDER, PairRecord
from lavis_ds.models.prompt import chatml_segments, insert_image_placeholders

FIXTURES = Path(__file__).parent / "fixtures" / "preference"
RLAIF_V_TOOLS = "RLAIF-V-Dataset_000_OmniLMM-12B_OmniLMM-12B_0"
# openbmb/RLAIF-V-Dataset train[0] as quoted in huggingface/blog vdpo.md (SOURCES.md).
LEATHER_Q = "Who is more likely to use these tools a leather crafter or a paper crafter?"
LEATHER_CHOSEN = (
    "A leather crafter is more likely to use these tools. The image shows various crafting tools, including scissors "
    "and a hole punch, which are commonly used in leatherworking projects. Leather is a material that requires "
    "cutting, shaping, and precise hole-punching techniques to create desired designs or patterns. In contrast, paper "
    "crafters typically use different types of tools, such as adhesives, decorative papers, or specialized cutting "
    "machines like the Silhouette Cameo, for their projects.")
LEATHER_REJECTED = (
    "A leather crafter is more likely to use these tools as they consist of a hole punch, scissors, and a knife. These "
    "items are typically used in crafting projects involving fabric or leather materials for various designs and "
    "patterns. Paper crafters may also benefit from some of these tools, but their primary focus would be on "
    "paper-related projects, which might require different types of tools such as paper cutters or scrapbooking "
    "supplies.")


@pytest.fixture
def image_root(tmp_path) -> Path:
    """The images the fixtures name, made here."""
    for name, colour in (("kitten.png", "orange"), ("puppy.png", "brown"), ("shapes/red_circle.png", "red"),
                         ("shapes/blue_square.png", "blue"), (f"{RLAIF_V_TOOLS}.jpg", "tan"),
                         ("train_countryside.jpg", "green")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (32, 32), colour).save(tmp_path / name)
    return tmp_path


def _load(name: str, pair_format: str, image_root: Path) -> list[PairRecord]:
    return list(RecordLoader(pair_parser(pair_format)).load([FIXTURES / name], image_root).records)


def test_llamafactory_sharegpt_ranking_records_load(image_root):
    single, multi, with_system = _load("llamafactory_dpo_en_demo.json", "sharegpt", image_root)
    assert single.instructions == ("Please give me the computation for 7818x86175. Only mathematical symbols, no "
                                   "verbal descriptions.",)
    assert single.chosen == "7818 x 86175 = 674667340" and single.rejected.startswith("7818 * 86175 = 86175 * (7000")
    assert single.history == () and single.images == ()
    assert len(multi.instructions) == 3 and len(multi.history) == 2  # the earlier answers are prompt
    assert multi.history[0].startswith("You are now in second place")
    assert multi.chosen.startswith("Certainly. The term") and multi.rejected.startswith("Certainly! When")
    assert with_system.system.startswith("You are an AI assistant")
    # the record store keeps every field of a pair
    assert list(pack([single, multi, with_system])) == [single, multi, with_system]


def test_chinese_pairs_with_their_own_system_turns_load(image_root):
    (shoes,) = _load("llamafactory_dpo_zh_demo.json", "sharegpt", image_root)
    assert shoes.system == "你是一个非常聪明的AI助手，非常擅长按照指示行事。尽你所能地帮助。"
    assert shoes.instructions[0].startswith("请阅读以下文章并选择最佳答案。")
    assert shoes.chosen == "每个房间里的展品都共享相同的主题。"
    weather, math = _load("swift_rlhf_text_zh.jsonl", "swift", image_root)
    assert (weather.system, weather.instructions, weather.chosen, weather.rejected) == (
        "你是个有用无害的助手", ("告诉我明天的天气",), "明天天气晴朗", "我不知道")
    assert math.system == "你是个有用无害的数学计算器" and math.history == ("等于2",)
    assert list(pack([shoes, weather, math])) == [shoes, weather, math]


def test_llamafactory_multimodal_both_spellings(image_root):
    conversations, messages = _load("llamafactory_multimodal.json", "sharegpt", image_root)
    assert conversations.images == ("shapes/red_circle.png",)
    assert conversations.instructions == (f"{IMAGE_PLACEHOLDER} What shape is this?",)
    assert (conversations.chosen, conversations.rejected) == ("A red circle.", "A blue square.")
    assert messages.instructions == (f"{IMAGE_PLACEHOLDER} Name the shape.", "And its colour?")
    assert messages.history == ("A square.",) and (messages.chosen, messages.rejected) == ("Blue.", "Red.")


def test_swift_rlhf_records_load(image_root):
    weather, math = _load("swift_rlhf_text.jsonl", "swift", image_root)
    assert weather.system == "You are a useful and harmless assistant"
    assert (weather.instructions, weather.chosen, weather.rejected) == (
        ("Tell me tomorrow's weather",), "Tomorrow's weather will be sunny", "I don't know")
    assert math.instructions == ("What is 1 + 1?", "What about adding 1?") and math.history == ("It equals 2",)
    by_messages, by_response, by_list = _load("swift_rlhf_multimodal.jsonl", "swift", image_root)
    for pair in (by_messages, by_response, by_list):  # three spellings of one pair
        assert (pair.images, pair.instructions, pair.chosen, pair.rejected) == (
            ("kitten.png",), (f"{IMAGE_PLACEHOLDER} What is this?",), "This is a kitten.", "This is a puppy.")


def test_swift_rejected_side_on_other_images_is_named(image_root):
    with pytest.raises(BadRecordsError) as info:
        _load("swift_rlhf_other_images.jsonl", "swift", image_root)
    assert [b.where.rpartition(": ")[2] for b in info.value.bad] == ["record 0 (images ['kitten.png'])",
                                                                    "record 1 (images ['kitten.png'])"]
    assert all("'rejected_images' ['puppy.png'] differ from 'images' ['kitten.png']" in b.problem
               for b in info.value.bad)


def test_rlaif_v_quoted_records_load(image_root):
    tools, train = _load("rlaif_v.json", "rlaif_v", image_root)
    assert tools.images == (f"{RLAIF_V_TOOLS}.jpg",) and train.images == ("train_countryside.jpg",)  # {"path"} only
    assert (tools.instructions, tools.chosen, tools.rejected) == (
        (f"{IMAGE_PLACEHOLDER} {LEATHER_Q}",), LEATHER_CHOSEN, LEATHER_REJECTED)  # unmarked: the image goes in front
    assert tools.record_id == "OmniLMM-12B_OmniLMM-12B_0" and tools.history == ()
    assert train.instructions == (f"{IMAGE_PLACEHOLDER} What is the setting or environment in which the image "
                                  f"takes place?",)
    assert (train.chosen, train.rejected, train.record_id) == (
        "The image depicts a train traveling on a track through a countryside setting with tall grass, trees, and "
        "power lines in the background.",
        "The image is set in an open area with train tracks, grassy fields, and trees in the background.", "not quoted")


def test_rlaif_v_pair_as_the_model_sees_it(image_root):
    sample = _builder(image_root, "rlaif_v.json", "rlaif_v").build()["train"][0]
    assert (sample["instruction"], sample["output"], sample["chosen"], sample["rejected"], sample["system"]) == (
        [f"{IMAGE_PLACEHOLDER} {LEATHER_Q}"], [], LEATHER_CHOSEN, LEATHER_REJECTED, None)
    prompt = insert_image_placeholders(sample["instruction"], "<|image_pad|>", 2)
    for answer in (sample["chosen"], sample["rejected"]):
        text = "".join(piece for piece, _ in chatml_segments("You are a helpful assistant.", prompt, [answer]))
        assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                        f"<Img><|image_pad|><|image_pad|></Img> {LEATHER_Q}<|im_end|>\n<|im_start|>assistant\n"
                        f"{answer}<|im_end|>\n")


def test_rlhf_v_text_json_loads(image_root):
    (pair,) = _load("rlhf_v.json", "rlhf_v", image_root)
    assert pair.instructions == (f"{IMAGE_PLACEHOLDER} What colour is the circle?",)
    assert (pair.chosen, pair.rejected, pair.record_id) == ("The circle is red.", "The circle is blue.", 0)


def test_missing_side_is_one_named_error(image_root):
    with pytest.raises(BadRecordsError, match=r"rlhf_v_missing_rejected.json: record 1 \(id 1, image "
                                              r"'shapes/blue_square.png'\): missing 'rejected'") as info:
        _load("rlhf_v_missing_rejected.json", "rlhf_v", image_root)
    assert len(info.value.bad) == 1  # the good record is not reported, and nothing is skipped silently


@pytest.mark.parametrize("record, message", [
    ({"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gpt", "value": "A"}},
     r"record 0: missing 'rejected' \(has \['chosen', 'conversations'\]\)"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
      "chosen": {"from": "gpt", "value": "A"}, "rejected": {"from": "gpt", "value": "B"}},
     r"'conversations' must end with the user's turn"),
    ({"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "human", "value": "A"},
      "rejected": {"from": "gpt", "value": "B"}}, r"chosen must be an assistant \('gpt' / 'assistant'\) turn"),
    ({"conversations": [{"from": "human", "value": "<image> Q"}], "chosen": {"from": "gpt", "value": "A"},
      "rejected": {"from": "gpt", "value": " "}, "images": ["kitten.png"]}, r"rejected is empty"),
    ({"conversations": [{"from": "human", "value": "<image><image> Q"}], "chosen": {"from": "gpt", "value": "A"},
      "rejected": {"from": "gpt", "value": "B"}, "images": ["kitten.png"]}, r"'<image>' appears 2 time\(s\)"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "system", "value": "S"}],
      "chosen": {"from": "gpt", "value": "A"}, "rejected": {"from": "gpt", "value": "B"}},
     r"record 0: conversations\[1\] is a system turn but not the first turn: the system prompt opens the "
     r"conversation \(move it to conversations\[0\]\)"),
    ({"conversations": [{"from": "system", "value": "S"}, {"from": "system", "value": "T"},
                        {"from": "human", "value": "Q"}],
      "chosen": {"from": "gpt", "value": "A"}, "rejected": {"from": "gpt", "value": "B"}},
     r"record 0: conversations\[0\] and conversations\[1\] are both system turns: a conversation has one system "
     r"prompt"),
    ({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}], "system": "T",
      "chosen": {"from": "gpt", "value": "A"}, "rejected": {"from": "gpt", "value": "B"}},
     r"has a 'system' column \('T'\) and a system turn in 'conversations' \('S'\): give the system prompt once"),
], ids=["missing-side", "no-prompt", "chosen-not-assistant", "empty-rejected", "markers", "system-not-first",
        "two-system-turns", "system-column-and-turn"])
def test_bad_sharegpt_pairs_are_named(tmp_path, image_root, record, message):
    import json

    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([record]))
    with pytest.raises(BadRecordsError, match=message):
        RecordLoader(pair_parser("sharegpt")).load([path], image_root)


def test_swift_rejected_messages_with_other_turns_is_named(tmp_path, image_root):
    import json

    record = {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                           {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}],
              "rejected_messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "B2"}]}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(BadRecordsError, match=r"pairs.jsonl: record 0: 'rejected_messages' has other prompt turns "
                                              r"than 'messages' \(1 vs 3 before the last answer"):
        RecordLoader(pair_parser("swift")).load([path], image_root)


def _builder(image_root: Path, name: str, pair_format: str) -> PreferencePairsBuilder:
    return PreferencePairsBuilder({
        "pair_format": pair_format,
        "build_info": {"annotations": {"train": {"storage": str(FIXTURES / name)}},
                       "images": {"storage": str(image_root)}},
        "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 16}}})


def test_builder_and_collater_give_each_pair_its_image_once(image_root):
    dataset = _builder(image_root, "swift_rlhf_multimodal.jsonl", "swift").build()["train"]
    assert isinstance(dataset, PairDataset) and len(dataset) == 3
    sample = dataset[1]
    assert (sample["chosen"], sample["rejected"], sample["output"]) == ("This is a kitten.", "This is a puppy.", [])
    batch = PairDataset.collater([dataset[0], dataset[1]])
    assert batch["image"].shape == (2, 3, 16, 16)  # two pairs, two images: not one per side
    assert batch["num_images"] == [1, 1] and batch["chosen"] == ["This is a kitten."] * 2


def test_builder_check_names_an_unknown_pair_format(image_root):
    problems = _builder(image_root, "rlaif_v.json", "rlaif").check()
    assert any("pair_format: expected 'sharegpt' | 'swift' | 'rlaif_v' | 'rlhf_v' | 'vlfeedback', got 'rlaif'" in p
               for p in problems), problems


def test_text_only_pairs_collate_without_images(image_root):
    dataset = _builder(image_root, "llamafactory_dpo_en_demo.json", "sharegpt").build()["train"]
    batch = PairDataset.collater([dataset[0], dataset[1]])
    assert batch["image"].shape[0] == 0 and batch["num_images"] == [0, 0]
    assert len(batch["output"][1]) == 2 and batch["system"] == [None, None]
    assert torch.is_tensor(batch["index"])


def test_vlfeedback_pairs_its_best_and_worst_rated_completion(image_root):
    good, bad = RecordLoader(pair_parser("vlfeedback")).read(FIXTURES / "vlfeedback.json", image_root)
    listed, parquet_layout = list(good)
    assert (listed.images, listed.chosen, listed.rejected) == (("shapes/red_circle.png",), "A red circle.",
                                                               "A blue triangle.")  # 5.0 vs 2.33 of four
    assert listed.instructions == (f"{IMAGE_PLACEHOLDER} What shape is in the image?",)
    # completions as one object of lists; 'N/A' ratings leave completion 0 out; 5.0 twice: the first listed wins
    assert (parquet_layout.record_id, parquet_layout.chosen, parquet_layout.rejected) == ("demo-2", "One circle.",
                                                                                          "Three squares.")
    assert [b.where.rpartition(": ")[2] for b in bad] == ["record 1 (id 'demo-1', image 'shapes/blue_square.png')"]
    assert bad[0].problem == ("its rated completions all have the same mean rating ([4.33, 4.33]): the record "
                              "gives no pair")


def _rated(response, *ratings):
    aspects = ("Helpfulness", "Ethical Considerations", "Visual Faithfulness")
    return {"model": "m", "response": response,
            "annotations": {a: {"Rating": r, "Rationale": ""} for a, r in zip(aspects, ratings)}}


@pytest.mark.parametrize("pair_format, record, message", [
    ("rlhf_v", {"text": "{'question': 'Q'}", "image_path": "kitten.png"}, r"'text' is not valid JSON"),
    ("rlhf_v", {"text": "[\"Q\", \"A\", \"B\"]", "image_path": "kitten.png"},
     r"'text' must be an object with question, chosen, rejected; got \['Q', 'A', 'B'\]"),
    ("rlaif_v", {"question": "Q", "chosen": None, "rejected": "B", "image": {"path": "kitten.png", "bytes": None}},
     r"'chosen' must be a string, got NoneType: None"),
    ("rlaif_v", {"question": "Q", "chosen": "A", "rejected": "B", "image": {"bytes": None, "path": None}},
     r"no image path: give 'image_path', or 'image' as a path"),
    ("vlfeedback", {"prompt": "Q", "img_path": "kitten.png",
                    "completions": {"response": ["A", "B"], "annotations": [{}], "model": ["m", "n"]}},
     r"'completions' as an object must hold lists of equal length.*\{'response': 2, 'annotations': 1, 'model': 2\}"),
    ("vlfeedback", {"prompt": "Q", "img_path": "kitten.png",
                    "completions": [_rated("A", "5", "5", "5"), _rated("B", "N/A", "5", "1")]},
     r"1 of its 2 completions have a numeric Rating for each of Helpfulness"),
    ("vlfeedback", {"prompt": "Q", "img_path": "kitten.png",
                    "completions": [_rated("A", "5", "5", "5"), _rated(None, "1", "5", "1")]},
     r"completions\[1\].response must be a string, got NoneType"),
], ids=["rlhf-text-not-json", "rlhf-text-list", "rlaif-chosen-null", "rlaif-image-bytes-only",
        "vlf-uneven-lists", "vlf-one-rated", "vlf-response-null"])
def test_bad_dataset_records_are_named(tmp_path, image_root, pair_format, record, message):
    import json

    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([record]))
    with pytest.raises(BadRecordsError, match=r"pairs.json: record 0.*: " + message):
        RecordLoader(pair_parser(pair_format)).load([path], image_root)
