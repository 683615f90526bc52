"""Processors, the instruction dataset, the builders and the demo_shapes generator, on real files."""
from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torch.utils.data import DataLoader

from lavis_ds.common.registry import builders as builder_registry
from lavis_ds.common.registry import processors as processor_registry
from lavis_ds.common.schema import fields_of
from lavis_ds.datasets import (
    IMAGE_PLACEHOLDER,
    DemoShapesBuilder,
    DemoShapesSpec,
    InstructionBuilder,
    InstructionDataset,
    ensure_demo_shapes,
)
from lavis_ds.processors import (
    CLIP_MEAN,
    CLIP_STD,
    Blip2ImageEvalProcessor,
    Blip2ImageTrainProcessor,
    BlipCaptionProcessor,
    ImageProcessing,
    PlainTextProcessor,
)

SMALL_DEMO = DemoShapesSpec(num_train=24, num_val=6, num_test=6, image_size=32, seed=3)


# ---- processors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(processor_registry))
def test_every_registered_processor_builds_from_its_config_section(name):
    """Built from ``{name: ...}`` alone, each processor makes what its defaults say: a normalised image of its
    default size, or the text without its surrounding spaces (a caption also lower-cased, without punctuation).
    A processor that does a vision tower's processing has no defaults: built alone it names what it lacks, and
    with a tower's keys (what the config loader fills in) it makes that tower's images."""
    cls = processor_registry.get(name)
    if name == "qwen_vl_image":  # Qwen's published processing by default: flat patches and a (t, h, w) grid
        out = cls.from_config({"name": name})(Image.new("RGB", (40, 30), (10, 20, 30)))
        assert out.grid_thw.tolist() == [1, 4, 6]  # smart_resize: 30 x 40 px up to 56 x 84 (min_pixels)
        assert out.pixel_values.shape == (24, 3 * 2 * 14 * 14) and out.pixel_values.min() < 0
        return
    if getattr(cls, "FROM_TOWER", False):
        with pytest.raises(ValueError, match=rf"^{name}: image_size, .* not set; they come from the model's vision"):
            cls.from_config({"name": name})
        processor = cls.from_config({"name": name, **ImageProcessing(40).processor_keys()})
        out = processor(Image.new("RGB", (40, 30), (10, 20, 30)))
        assert out.shape == (3, 40, 40) and out.dtype == torch.float32 and out.min() < 0
        return
    processor = cls.from_config({"name": name})
    if "image" in name:
        size = fields_of(cls)["image_size"][1]
        out = processor(Image.new("RGB", (40, 30), (10, 20, 30)))
        assert out.shape == (3, size, size) and out.dtype == torch.float32
        assert out.min() < 0  # normalised by the mean and std, not left in [0, 1]
    else:
        assert processor("  Some Text.  ") == ("some text" if name == "blip_caption" else "Some Text.")


def test_eval_processor_resizes_normalises_and_is_deterministic():
    processor = Blip2ImageEvalProcessor.from_config({"name": "blip2_image_eval", "image_size": 32})
    image = Image.new("RGB", (50, 20), (255, 0, 128))
    out = processor(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    expected = [(v / 255 - m) / s for v, m, s in zip((255, 0, 128), CLIP_MEAN, CLIP_STD)]
    assert torch.allclose(out.mean(dim=(1, 2)), torch.tensor(expected), atol=1e-3)
    assert torch.equal(out, processor(image))


def test_train_processor_is_random_but_keeps_the_shape():
    processor = Blip2ImageTrainProcessor(image_size=24, min_scale=0.3)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 40, 3), dtype=np.uint8))
    outs = [processor(image) for _ in range(4)]
    assert all(o.shape == (3, 24, 24) and o.dtype == torch.float32 for o in outs)
    assert any(not torch.equal(outs[0], o) for o in outs[1:])


def test_image_processors_convert_to_rgb():
    assert Blip2ImageEvalProcessor(image_size=8)(Image.new("L", (8, 8), 100)).shape == (3, 8, 8)
    assert Blip2ImageEvalProcessor(image_size=8)(Image.new("RGBA", (8, 8))).shape == (3, 8, 8)


def test_processor_config_errors_are_clear():
    with pytest.raises(ValueError, match=r"'imagesize' \(did you mean 'image_size'\?\)"):
        Blip2ImageEvalProcessor.from_config({"name": "blip2_image_eval", "imagesize": 224})
    with pytest.raises(ValueError, match="min_scale <= max_scale"):
        Blip2ImageTrainProcessor(min_scale=0.9, max_scale=0.5)


def test_text_processors():
    caption = BlipCaptionProcessor(prompt="a picture of ", max_words=4)
    assert caption("  A Dog (running):   in the PARK!\n") == "a picture of a dog running in"
    assert PlainTextProcessor()("  Keep: Case!  \n") == "Keep: Case!"


# ---- instruction dataset ------------------------------------------------------------------------

def _write_images(root: Path, *names: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        Image.new("RGB", (20 + i, 16), (40 * i, 100, 200)).save(root / name)


def _write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records))
    return path


@pytest.fixture
def instruction_files(tmp_path):
    _write_images(tmp_path / "images", "a.png", "b.png")
    single = _write_json(tmp_path / "single.json", [
        {"image": "a.png", "instruction": f"{IMAGE_PLACEHOLDER} What Is This?", "output": "A cat."},
    ])
    multi = _write_json(tmp_path / "multi.json", [
        {"image": "b.png", "instruction": [f"{IMAGE_PLACEHOLDER} First?", "Second?"], "output": ["one", "two"]},
    ])
    return tmp_path, single, multi


def test_single_and_multi_turn_records_load_and_collate(instruction_files):
    root, single, multi = instruction_files
    dataset = InstructionDataset([single, multi], root / "images", Blip2ImageEvalProcessor(image_size=16))
    assert len(dataset) == 2
    first = dataset[0]
    assert first["image"].shape == (1, 3, 16, 16)
    assert first["instruction"] == [f"{IMAGE_PLACEHOLDER} What Is This?"] and first["output"] == ["A cat."]
    assert dataset[1]["instruction"] == [f"{IMAGE_PLACEHOLDER} First?", "Second?"]

    batch = next(iter(DataLoader(dataset, batch_size=2, collate_fn=dataset.collater)))
    assert batch["image"].shape == (2, 3, 16, 16)
    assert batch["instruction"] == [[f"{IMAGE_PLACEHOLDER} What Is This?"], [f"{IMAGE_PLACEHOLDER} First?", "Second?"]]
    assert batch["output"] == [["A cat."], ["one", "two"]]
    assert batch["index"].dtype == torch.long and batch["index"].tolist() == [0, 1]


def test_text_processor_applies_to_every_turn_but_not_to_the_image_placeholder(instruction_files):
    root, single, multi = instruction_files
    dataset = InstructionDataset([single, multi], root / "images", Blip2ImageEvalProcessor(image_size=16),
                                 text_processor=BlipCaptionProcessor())
    assert dataset[0]["instruction"] == [f"{IMAGE_PLACEHOLDER} what is this?"]
    assert dataset[0]["output"] == ["a cat"]
    assert dataset[1]["instruction"] == [f"{IMAGE_PLACEHOLDER} first?", "second?"]


@pytest.mark.parametrize("record, problem", [
    ({"image": "a.png", "output": "x"}, r"missing key\(s\) 'instruction'"),
    ({"image": "a.png", "instruction": ["q1", "q2"], "output": ["a1"]},
     r"same length.*2 instruction\(s\) and 1 output"),
    ({"image": "a.png", "instruction": ["q1"], "output": "a1"}, "must both be strings or both lists"),
    ({"image": "a.png", "instruction": "q", "output": 3}, "'output' must be a string or a list of strings"),
    ({"image": "a.png", "instruction": ["q", None], "output": ["a", "b"]}, r"'instruction'\[1\] must be a string"),
    ({"image": 7, "instruction": "q", "output": "a"}, "'image' must be a non-empty string"),
])
def test_malformed_record_names_file_and_record_at_load_time(tmp_path, record, problem):
    good = {"image": "a.png", "instruction": "q", "output": "a"}
    path = _write_json(tmp_path / "bad.json", [good, good, record])
    with pytest.raises(ValueError, match=rf"bad\.json: record 2.*{problem}"):
        InstructionDataset(path, tmp_path, Blip2ImageEvalProcessor())


def test_not_a_list_or_not_json_is_reported_with_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"obj\.json: expected a JSON list"):
        InstructionDataset(_write_json(tmp_path / "obj.json", {"image": "a.png"}), tmp_path, Blip2ImageEvalProcessor())
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON"):
        InstructionDataset(tmp_path / "broken.json", tmp_path, Blip2ImageEvalProcessor())


def test_missing_image_names_the_file_and_the_record(instruction_files):
    root, single, _ = instruction_files
    dataset = InstructionDataset(single, root / "images", Blip2ImageEvalProcessor())
    (root / "images" / "a.png").unlink()  # gone after loading (a missing one at load time is a bad record)
    where = r"single\.json: record 0 \(image 'a\.png'\)"
    with pytest.raises(FileNotFoundError, match=rf"{where}: image file .*a\.png not found"):
        dataset[0]


# ---- builders -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(builder_registry))
def test_every_registered_builder_has_a_default_config(name):
    cls = builder_registry.get(name)
    assert cls.default_config_path() is not None and "vis_processor" in cls.default_config()


def _section(root: Path, single: Path, multi: Path) -> dict:
    return {
        "build_info": {
            "annotations": {"train": {"storage": [str(single), str(multi)]}, "val": {"storage": str(single)}},
            "images": {"storage": str(root / "images")},
        },
        "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 16},
                          "eval": {"name": "blip2_image_eval", "image_size": 12}},
        "text_processor": {"train": {"name": "plain_text"}, "eval": {"name": "plain_text"}},
    }


def test_instruction_builder_uses_train_processors_for_train_and_eval_for_the_rest(instruction_files):
    builder = InstructionBuilder(_section(*instruction_files))
    assert builder.check() == []
    splits = builder.build()
    assert {k: len(v) for k, v in splits.items()} == {"train": 2, "val": 1}
    assert splits["train"][0]["image"].shape == (1, 3, 16, 16)
    assert splits["val"][0]["image"].shape == (1, 3, 12, 12)


def test_builder_check_reports_every_problem_with_its_key_path(instruction_files, tmp_path):
    section = _section(*instruction_files)
    section["build_info"]["annotations"]["val"]["storage"] = str(tmp_path / "gone.json")
    section["build_info"]["images"]["storage"] = str(tmp_path / "no_images")
    section["text_processor"]["eval"] = {"name": "blip_captoin"}
    problems = InstructionBuilder(section, section_name="mine").check()
    assert len(problems) == 3, problems
    assert any(p.startswith("datasets.mine.build_info.annotations.val.storage: annotation file")
               and "gone.json does not exist" in p for p in problems)
    assert any(p.startswith("datasets.mine.build_info.images.storage: image folder") for p in problems)
    assert any("text_processor.eval" in p and "did you mean 'blip_caption'" in p.lower() for p in problems)
    with pytest.raises(ValueError, match=r"gone\.json does not exist"):
        InstructionBuilder(section).build()


def test_builder_names_the_users_section_key_when_given_a_config_node(tmp_path):
    cfg = OmegaConf.create({"datasets": {"my_data": {"builder": "minigpt4qwen_instruction", "build_info": {
        "annotations": {"train": {"storage": str(tmp_path / "a.json")}}, "images": {"storage": str(tmp_path)}}}}})
    assert InstructionBuilder(cfg.datasets.my_data).check() == [
        f"datasets.my_data.build_info.annotations.train.storage: annotation file {tmp_path / 'a.json'} does not exist"]


# ---- demo_shapes --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return ensure_demo_shapes(tmp_path_factory.mktemp("demo") / "shapes", SMALL_DEMO)


def test_demo_generation_is_deterministic(demo_dir, tmp_path):
    again = ensure_demo_shapes(tmp_path / "again", SMALL_DEMO)
    for split in ("train", "val", "test"):
        name = f"annotations/{split}.json"
        assert (demo_dir / name).read_bytes() == (again / name).read_bytes()
    images = sorted(p.name for p in (demo_dir / "images").iterdir())
    assert images == sorted(p.name for p in (again / "images").iterdir())
    assert len(images) == 24 + 6 + 6
    for name in images:
        assert np.array_equal(np.asarray(Image.open(demo_dir / "images" / name)),
                              np.asarray(Image.open(again / "images" / name)))


def test_demo_content_has_captions_questions_and_multi_turn(demo_dir):
    train = json.loads((demo_dir / "annotations/train.json").read_text())
    test = json.loads((demo_dir / "annotations/test.json").read_text())
    assert {r["instruction"] for r in test} == {f"{IMAGE_PLACEHOLDER} Describe the image in a few words."}
    assert all(r["output"].split()[0] in ("a", "an") and len(r["output"].split()) == 3 for r in test)
    assert any(isinstance(r["instruction"], list) for r in train)
    assert Image.open(demo_dir / "images" / test[0]["image"]).size == (32, 32)


def test_demo_builder_builds_and_its_tokenizer_loads(demo_dir):
    from transformers import AutoTokenizer

    builder = DemoShapesBuilder({"build_info": {"storage": str(demo_dir), **vars(SMALL_DEMO)}})
    splits = builder.build()
    assert {k: len(v) for k, v in splits.items()} == {"train": 24, "val": 6, "test": 6}
    assert splits["train"][0]["image"].shape == (1, 3, 64, 64)  # the builder's default processors
    tokenizer = AutoTokenizer.from_pretrained(builder.tokenizer_dir)
    ids = tokenizer("<|im_start|>user\nWhat shape is it?<|im_end|>")["input_ids"]
    assert tokenizer.decode(ids) == "<|im_start|>user\nWhat shape is it?<|im_end|>"


def test_demo_refuses_a_cache_made_with_other_parameters_or_incomplete(demo_dir, tmp_path):
    other = DemoShapesSpec(**{**vars(SMALL_DEMO), "num_train": 25})
    with pytest.raises(ValueError, match="num_train: 24 on disk vs 25 requested"):
        ensure_demo_shapes(demo_dir, other)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "stray.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a complete demo_shapes dataset"):
        ensure_demo_shapes(tmp_path / "half", SMALL_DEMO)
    builder = DemoShapesBuilder({"build_info": {"storage": str(tmp_path / "never")}})
    assert (builder.check(), builder.generates()) == ([], [tmp_path / "never"])  # the build generates it
    assert not (tmp_path / "never").exists()


def test_demo_regenerates_a_cache_from_an_older_format(demo_dir, tmp_path):
    import shutil

    from lavis_ds.datasets.demo_shapes import FORMAT_VERSION

    old = tmp_path / "old"
    shutil.copytree(demo_dir, old)
    done = json.loads((old / "DONE").read_text())
    (old / "DONE").write_text(json.dumps({**done, "format_version": FORMAT_VERSION - 1}))
    (old / "images" / "train_00000.png").write_bytes(b"an image an older version drew")
    ensure_demo_shapes(old, SMALL_DEMO)
    assert json.loads((old / "DONE").read_text())["format_version"] == FORMAT_VERSION
    assert (old / "images" / "train_00000.png").read_bytes() == (demo_dir / "images" / "train_00000.png").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["old"]  # nothing stale left beside it


def _race(storage: str, barrier) -> None:
    barrier.wait()  # both processes find the folder missing and generate at the same time
    ensure_demo_shapes(storage, SMALL_DEMO)


def test_two_processes_generating_at_once_leave_one_valid_dataset(tmp_path):
    # fork: the race is on the file system, and spawn would re-import torch and the whole
    # package in each child (tens of seconds on a busy 2-core machine).
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    storage = tmp_path / "shared" / "demo"
    procs = [ctx.Process(target=_race, args=(str(storage), barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [p.name for p in storage.parent.iterdir()] == ["demo"]  # losers' scratch folders are gone
    builder = DemoShapesBuilder({"build_info": {"storage": str(storage), **vars(SMALL_DEMO)}})
    assert builder.check() == []
