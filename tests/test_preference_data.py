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

FIXTURES = Path(__file__).parent / "fixtures" / "preference"


@pytest.fixture
def image_root(tmp_path) -> Path:
    """The images the fixtures name, made here."""
    for name, colour in (("kitten.png", "orange"), ("puppy.png", "brown"), ("shapes/red_circle.png", "red"),
                         ("shapes/blue_square.png", "blue")):
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


def test_rlaif_v_and_rlhf_v_records_load(image_root):
    first, second = _load("rlaif_v.json", "rlaif_v", image_root)
    assert first.images == ("shapes/red_circle.png",) and second.images == ("shapes/blue_square.png",)  # {"path"}
    assert first.instructions == (f"{IMAGE_PLACEHOLDER} What shape is in the image?",)  # unmarked: image in front
    assert (first.chosen, first.rejected, first.record_id) == ("A red circle on a white background.",
                                                               "A blue square on a white background.", "0")
    (pair,) = _load("rlhf_v.json", "rlhf_v", image_root)
    assert (pair.chosen, pair.rejected) == ("The circle is red.", "The circle is blue.")


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
], ids=["missing-side", "no-prompt", "chosen-not-assistant", "empty-rejected", "markers"])
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


def test_vlfeedback_pairs_its_best_and_worst_rated_completion_and_names_a_tie(image_root, tmp_path):
    import json

    with pytest.raises(BadRecordsError, match=r"vlfeedback.json: record 1 \(id 'demo-1', image "
                                              r"'shapes/blue_square.png'\): no single best and worst completion "
                                              r"\(mean ratings \[4.33, 4.33\]\)"):
        _load("vlfeedback.json", "vlfeedback", image_root)
    first = json.loads((FIXTURES / "vlfeedback.json").read_text())[0]
    (tmp_path / "one.json").write_text(json.dumps([first]))
    (pair,) = RecordLoader(pair_parser("vlfeedback")).load([tmp_path / "one.json"], image_root).records
    assert (pair.images, pair.chosen, pair.rejected) == (("shapes/red_circle.png",), "A red circle.",
                                                         "A blue triangle.")
    assert pair.instructions == (f"{IMAGE_PLACEHOLDER} What shape is in the image?",)
