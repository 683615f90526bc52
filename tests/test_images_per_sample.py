"""0..N images per sample: text-only, several-image and video records, from parsing to the model's placeholders.

The records follow published files (each fixture names its source); images are PNGs made with PIL and
videos real MPEG-4 files written with PyAV, whose frame k is a flat grey of level 20 * k, so a sampled
frame tells which one it was.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from lavis_ds.datasets import (BadRecordsError, InstructionDataset, LlavaConversationBuilder, RecordLoader,
                               UnreadableVideoError)
from lavis_ds.datasets.builders import InstructionBuilder
from lavis_ds.datasets.instruction import expand_video_marker, process_text
from lavis_ds.datasets.llava import parse_llava_file
from lavis_ds.datasets.records import IMAGE_PLACEHOLDER, BadRecord
from lavis_ds.datasets.video import read_frames, uniform_indices
from lavis_ds.models import Blip2Qwen
from lavis_ds.processors import Blip2ImageEvalProcessor, BlipCaptionProcessor
from run_utils import metrics, output_of, start, tiny_config, train_steps, write_yaml

IMG = IMAGE_PLACEHOLDER
EVAL_64 = {"train": {"name": "blip2_image_eval", "image_size": 64}, "eval": {"name": "blip2_image_eval", "image_size": 64}}


def _human(text):
    return {"from": "human", "value": text}


def _gpt(text):
    return {"from": "gpt", "value": text}


# llava_v1_5_mix665k.json mixes LLaVA-Instruct records (the first record of llava_instruct_150k, id 000000033471,
# abridged to two turns) with ShareGPT conversations, which have no "image" key. The text-only record is
# ShareGPT_V3_unfiltered_cleaned_split.json's first, as skypilot-org/skypilot llm/vicuna-llama-2/README.md quotes
# it (its gpt answer shortened here).
MIX665K_SINGLE_IMAGE = {"id": "000000033471", "image": "coco/train2017/000000033471.jpg", "conversations": [
    _human("<image>\nWhat are the colors of the bus in the image?"), _gpt("The bus in the image is white and red."),
    _human("What feature can be seen on the back of the bus?"), _gpt("The back of the bus features an advertisement.")]}
MIX665K_TEXT_ONLY = {"id": "i6IyJda_0", "conversations": [
    _human("How to tell if a customer segment is well segmented? In 3 bullet points."),
    _gpt("1. Homogeneity: The segment should consist of customers who share similar characteristics and behaviors.")]}
# LLaVA's multi-image format as LLaVA-NeXT's llava/train/train.py reads it: "image" is a list, one <image> per image
# (preprocess_multimodal moves a turn's <image> to its front only when the turn has exactly one).
LLAVA_MULTI_IMAGE = {"id": "multi_0", "image": ["coco/train2017/000000033471.jpg", "coco/train2017/000000052846.jpg"],
                     "conversations": [_human("<image>\n<image>\nWhat is different between the two images?"),
                                       _gpt("The first shows a bus, the second a cat.")]}
# MPP-LLaVA's video record: the keys its lavis/datasets/datasets/video_instructions.py reads ("video",
# "instruction" with one <Img><ImageHere></Img>, "output"), which it rewrites to <Img> + <ImageHere> x frames + </Img>.
MPP_VIDEO = {"video": "v_demo.mp4", "instruction": "<Img><ImageHere></Img> What happens in the video?",
             "output": "The screen fades from black to light grey."}
# MPP-LLaVA's several-image instruction: cli_demo.py writes `<Img>` + "<ImageHere>" x images + `</Img> ` + query.
MPP_MULTI_IMAGE = {"image": ["coco/train2017/000000033471.jpg", "coco/train2017/000000052846.jpg"],
                   "instruction": "<Img><ImageHere><ImageHere></Img> Which image shows an animal?",
                   "output": "The second one."}


def write_video(path: Path, frames: int, size=(32, 24), fps: int = 8) -> Path:
    """An MPEG-4 file whose frame k is a flat grey of level 20 * k."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for k in range(frames):
            pixels = np.full((size[1], size[0], 3), 20 * k, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_data(root: Path, video_frames: int = 10) -> Path:
    """The images and the video the fixture records name, under ``root``."""
    for name, colour in (("coco/train2017/000000033471.jpg", (200, 30, 30)), ("coco/train2017/000000052846.jpg",
                                                                              (30, 200, 30))):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30), colour).save(root / name)
    write_video(root / MPP_VIDEO["video"], video_frames)
    return root


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records))
    return path


def _levels(pixels: torch.Tensor) -> list[int]:
    """The grey level of each frame, undoing the CLIP normalisation of the red channel."""
    return [round(float(p[0].mean() * 0.26862954 + 0.48145466) * 255) for p in pixels]


# ---- records ----------------------------------------------------------------------------------------

def test_mix665k_text_only_and_several_image_llava_records_are_samples(tmp_path):
    path = write_json(tmp_path / "mix.json", [MIX665K_SINGLE_IMAGE, MIX665K_TEXT_ONLY, LLAVA_MULTI_IMAGE])
    records = list(RecordLoader(parse_llava_file, check_images=False).load([path], None).records)
    single, text_only, multi = records
    assert single.images == ("coco/train2017/000000033471.jpg",)
    assert single.instructions[0] == f"{IMG} What are the colors of the bus in the image?"
    assert text_only.images == () and text_only.image is None
    assert text_only.instructions == ("How to tell if a customer segment is well segmented? In 3 bullet points.",)
    assert text_only.where() == f"{path}: record 1 (id 'i6IyJda_0')"
    assert multi.images == tuple(LLAVA_MULTI_IMAGE["image"])
    assert multi.instructions == (f"{IMG}\n{IMG}\nWhat is different between the two images?",)
    assert multi.where().endswith(f"record 2 (id 'multi_0', images {LLAVA_MULTI_IMAGE['image']})")
    # skip_text_only stays as the opt-out: the text-only record is left out and counted.
    parse = functools.partial(parse_llava_file, skip_text_only=True)
    loaded = RecordLoader(parse, skip={BadRecord.TEXT_ONLY}, check_images=False).load([path], None)
    assert len(loaded.records) == 2 and [b.kind for b in loaded.skipped] == [BadRecord.TEXT_ONLY]


def test_mpp_llava_video_and_several_image_records_load_with_their_files(tmp_path):
    root = write_data(tmp_path / "data")
    path = write_json(tmp_path / "mpp.json", [MPP_VIDEO, MPP_MULTI_IMAGE, {"instruction": "Hi", "output": "Hello"}])
    video, multi, text_only = InstructionDataset(path, root, Blip2ImageEvalProcessor(image_size=16)).records
    assert video.video == "v_demo.mp4" and video.images == () and video.image == "v_demo.mp4"
    assert video.where() == f"{path}: record 0 (video 'v_demo.mp4')"
    assert multi.images == tuple(MPP_MULTI_IMAGE["image"]) and multi.image == ", ".join(MPP_MULTI_IMAGE["image"])
    assert text_only.files == ()


BAD = [
    ({**MPP_MULTI_IMAGE, "instruction": "<Img><ImageHere></Img> Which one?"},
     r"record 0 \(images \[.*\]\): 1 <ImageHere> marker\(s\) in its instructions but 2 image\(s\): valid is one "
     r"<ImageHere> per image, in image order"),
    ({"instruction": "<Img><ImageHere></Img> What?", "output": "x"},
     r"record 0: 1 <ImageHere> marker\(s\) in its instructions but 0 image\(s\)"),
    ({**MPP_VIDEO, "instruction": "<Img><ImageHere></Img> a <Img><ImageHere></Img> b"},
     r"record 0 \(video 'v_demo\.mp4'\): 2 <ImageHere> marker\(s\) in its instructions but a video"),
    ({**MPP_VIDEO, "image": "coco/train2017/000000033471.jpg"}, r"record 0: has both 'image' and 'video'; a record holds images or one video"),
    ({**MPP_VIDEO, "video": ""}, r"record 0: 'video' must be a non-empty string"),
    ({**MPP_VIDEO, "video": "missing.mp4"}, r"record 0 \(video 'missing\.mp4'\): video file .*missing\.mp4 not found"),
]


@pytest.mark.parametrize("record, message", BAD, ids=[m[:40] for _, m in BAD])
def test_each_bad_record_is_named_at_load_time_with_what_would_be_valid(tmp_path, record, message):
    root = write_data(tmp_path / "data")
    path = write_json(tmp_path / "bad.json", [record])
    with pytest.raises(BadRecordsError, match=rf"bad\.json: {message}"):
        InstructionDataset(path, root, Blip2ImageEvalProcessor(image_size=16))


def test_text_processors_keep_marker_groups_of_several_images():
    caption = BlipCaptionProcessor()
    assert process_text("<Img><ImageHere><ImageHere></Img> Which One?", caption) == \
        "<Img><ImageHere><ImageHere></Img> which one?"
    assert process_text(f"{IMG} What Is This?", caption) == f"{IMG} what is this?"  # as before


def test_a_video_marker_becomes_one_marker_per_frame():
    assert expand_video_marker(["<Img><ImageHere></Img> What?", "And then?"], 3) == \
        ["<Img><ImageHere><ImageHere><ImageHere></Img> What?", "And then?"]
    assert expand_video_marker(["What?"], 2) == ["<Img><ImageHere><ImageHere></Img> What?"]


# ---- videos -----------------------------------------------------------------------------------------

def test_frames_are_sampled_uniformly_and_a_short_video_gives_all_its_frames(tmp_path):
    assert uniform_indices(10, 4) == [0, 3, 6, 9] and uniform_indices(3, 8) == [0, 1, 2]
    to_tensor = Blip2ImageEvalProcessor(image_size=16)
    frames = read_frames(write_video(tmp_path / "ten.mp4", 10), max_frames=4)
    assert [abs(level - expected) <= 4 for level, expected in
            zip(_levels(torch.stack([to_tensor(f) for f in frames])), [0, 60, 120, 180])] == [True] * 4
    assert len(read_frames(write_video(tmp_path / "three.mkv", 3), max_frames=8)) == 3  # mkv: no frame count


def test_an_unreadable_video_names_the_file_and_the_record(tmp_path):
    root = write_data(tmp_path / "data")
    (root / "v_demo.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    path = write_json(tmp_path / "videos.json", [MPP_VIDEO])
    dataset = InstructionDataset(path, root, Blip2ImageEvalProcessor(image_size=16))  # existence is checked
    with pytest.raises(UnreadableVideoError, match=r"videos\.json: record 0 \(video 'v_demo\.mp4'\): cannot read "
                                                   r"video file .*v_demo\.mp4"):
        dataset[0]


# ---- samples and the batch layout ---------------------------------------------------------------------

def test_a_micro_batch_holds_every_image_flat_with_per_sample_counts(tmp_path):
    root = write_data(tmp_path / "data", video_frames=3)  # fewer frames than max_frames: all three are used
    path = write_json(tmp_path / "mix.json", [{"instruction": "Hi", "output": "Hello"}, MPP_MULTI_IMAGE, MPP_VIDEO])
    dataset = InstructionDataset(path, root, Blip2ImageEvalProcessor(image_size=16), max_frames=4)
    text_only, multi, video = dataset[0], dataset[1], dataset[2]
    assert text_only["image"].shape == (0, 3, 16, 16) and text_only["num_images"] == 0
    assert multi["image"].shape == (2, 3, 16, 16)
    assert video["image"].shape == (3, 3, 16, 16) and dataset.short_videos == 1
    assert video["instruction"] == ["<Img><ImageHere><ImageHere><ImageHere></Img> What happens in the video?"]
    batch = dataset.collater([text_only, multi, video])
    assert batch["image"].shape == (5, 3, 16, 16) and batch["num_images"] == [0, 2, 3]
    torch.testing.assert_close(batch["image"][2:], video["image"])
    empty = dataset.collater([text_only, text_only])
    assert empty["image"].shape == (0, 3, 16, 16) and empty["num_images"] == [0, 0]


@pytest.fixture
def model(tiny_model_config) -> Blip2Qwen:
    torch.manual_seed(0)
    return Blip2Qwen.from_config(tiny_model_config).eval()


def _mixed_batch() -> dict:
    torch.manual_seed(1)
    return {"image": torch.randn(3, 3, 64, 64), "num_images": [0, 2, 1],
            "instruction": [["What color is the ball?"], ["<Img><ImageHere><ImageHere></Img> What is in the image?"],
                            ["Describe the picture in detail.", "<Img><ImageHere></Img> What color is the ball?"]],
            "output": [["It is red."], ["A cat sitting on a mat."], ["A dog runs on the grass.", "It is red."]]}


def test_each_images_features_go_where_its_marker_stands(model):
    batch = model.prepare_batch(_mixed_batch())
    ids, n_query = batch["input_ids"], model.llm.prompt.num_image_tokens
    is_image = ids == model.llm.prompt.image_token_id
    assert is_image.sum(1).tolist() == [0, 2 * n_query, n_query]
    with torch.no_grad():
        features = model.image_path.encode(batch["image"], {})
        embeds = model.image_path.embed(ids, features)
    torch.testing.assert_close(embeds[1][is_image[1]], features[:2].flatten(0, 1))
    torch.testing.assert_close(embeds[2][is_image[2]], features[2])
    # Sample 2's image belongs to its second turn: its placeholders come after the first answer.
    first_answer = model.llm.tokenizer("A dog runs on the grass.", add_special_tokens=False)["input_ids"]
    row = ids[2].tolist()
    answer_at = next(i for i in range(len(row)) if row[i:i + len(first_answer)] == first_answer)
    assert is_image[2].nonzero().min() > answer_at


def test_the_flat_batch_gives_each_samples_own_loss(model):
    batch = _mixed_batch()
    with torch.no_grad():
        together = model(batch)
        alone = [model({"image": batch["image"][start:start + n], "num_images": [n], "instruction": [ins],
                        "output": [out]})
                 for start, n, ins, out in zip((0, 0, 2), batch["num_images"], batch["instruction"], batch["output"])]
    torch.testing.assert_close(together["loss_sum"], sum(out["loss_sum"] for out in alone))
    assert int(together["num_tokens"]) == sum(int(out["num_tokens"]) for out in alone)


def test_a_micro_batch_without_images_still_runs_the_towers_once_with_zero_gradient(model):
    """ZeRO-3 and FSDP need every rank to run the same modules: an image-free micro-batch runs them on a blank
    image whose features count zero times."""
    calls = []
    model.vision_tower.vit.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    model.train()
    batch = {"image": torch.zeros((0, 3, 64, 64)), "num_images": [0, 0], "instruction": [["Hi"], ["How many?"]],
             "output": [["Hello"], ["Two."]]}
    out = model(batch)
    out["loss"].backward()
    assert calls == [1] and torch.isfinite(out["loss"])
    assert model.connector.llm_proj.weight.grad is not None and not model.connector.llm_proj.weight.grad.any()
    assert model.llm_model.get_input_embeddings().weight.grad.any()  # the text itself trains
    torch.manual_seed(0)
    reference = {k: v for k, v in batch.items() if k != "image"}  # same numbers without the image key at all
    with torch.no_grad():
        torch.testing.assert_close(model(reference)["loss"], out["loss"].detach())
    # Generation runs no tower for a text-only batch unless its ranks are synced (ZeRO-3 / FSDP).
    calls.clear()
    model.eval()
    model.generate(batch, max_new_tokens=2)
    assert calls == []
    model.generate(_mixed_batch(), max_new_tokens=2)
    assert calls == [3]


def test_counts_that_do_not_add_up_are_an_error(model):
    batch = {**_mixed_batch(), "num_images": [0, 2, 2]}
    with pytest.raises(ValueError, match=r"num_images \[0, 2, 2\] adds up to 4 images, but the batch holds 3"):
        model(batch)


# ---- builders -----------------------------------------------------------------------------------------

def test_mpp_llavas_videochatgpt_100k_section_builds(tmp_path):
    """MPP-LLaVA's defaults.yaml for videochatgpt_100k: data_type images, the videos under images.storage,
    build_info.max_frames 32 beside them (lavis/configs/datasets/videochatgpt_100k/defaults.yaml)."""
    from lavis_ds.common.registry import registry

    root = write_data(tmp_path / "videochatgpt_tune")
    path = write_json(tmp_path / "videochatgpt_instruction_100k.json", [MPP_VIDEO])
    builder_cls = registry.get_builder_class("videochatgpt_100k")
    assert builder_cls is InstructionBuilder
    section = {"data_type": "images", "build_info": {"annotations": {"train": {"storage": str(path)}},
                                                     "images": {"storage": str(root)}, "max_frames": 4},
               "vis_processor": EVAL_64}
    train = builder_cls(section).build()["train"]
    assert train[0]["image"].shape == (4, 3, 64, 64) and train[0]["num_images"] == 4
    # data_type: videos reads build_info.videos.storage (what LAVIS's builder takes for that data_type).
    videos = {**section, "data_type": "videos", "build_info": {**section["build_info"], "images": None,
                                                               "videos": {"storage": str(root)}}}
    del videos["build_info"]["images"]
    assert len(builder_cls(videos).build()["train"]) == 1
    bad = {**section, "build_info": {**section["build_info"], "max_frames": 0}}
    assert any("build_info.max_frames: expected a positive integer" in p for p in builder_cls(bad).check())


def test_a_llava_section_trains_text_only_records_unless_skip_text_only(tmp_path):
    root = write_data(tmp_path / "llava")
    path = write_json(tmp_path / "mix665k.json", [MIX665K_SINGLE_IMAGE, MIX665K_TEXT_ONLY, LLAVA_MULTI_IMAGE])
    section = {"build_info": {"annotations": {"train": {"storage": str(path)}}, "images": {"storage": str(root)}},
               "vis_processor": EVAL_64}
    train = LlavaConversationBuilder(section).build()["train"]
    assert [train[i]["num_images"] for i in range(3)] == [1, 0, 2]
    skipping = LlavaConversationBuilder({**section, "skip_text_only": True}).build()["train"]
    assert len(skipping) == 2 and [b.kind for b in skipping.skipped] == [BadRecord.TEXT_ONLY]


# ---- a real run ---------------------------------------------------------------------------------------

def _run_config(out: Path, data: Path, tokenizer: Path, runner: str) -> dict:
    root = write_data(data / "media", video_frames=6)
    llava = write_json(data / "llava_v1_5_mix665k.json",
                       [MIX665K_TEXT_ONLY] * 6 + [MIX665K_SINGLE_IMAGE] * 3 + [LLAVA_MULTI_IMAGE] * 3)
    mpp = write_json(data / "videochatgpt_instruction_100k.json", [MPP_VIDEO, MPP_MULTI_IMAGE] * 2)
    train_64 = {"train": {"name": "blip2_image_train", "image_size": 64}, "eval": {"name": "blip2_image_eval",
                                                                                  "image_size": 64}}

    def section(builder, path, **build_info):
        return {"builder": builder, "vis_processor": train_64, "build_info": {
            "annotations": {"train": {"storage": str(path)}, "val": {"storage": str(path)}},
            "images": {"storage": str(root)}, **build_info}}

    cfg = tiny_config(out, data, stage=3, micro=1, max_epoch=1, runner=runner, valid_splits=["val"],
                      val_metrics=["exact_match"], generate={"max_new_tokens": 4})
    cfg["model"]["tokenizer"] = str(tokenizer)
    cfg["datasets"] = {"mix665k": section("llava_conversation", llava),
                       "videochatgpt": section("videochatgpt_100k", mpp, max_frames=4)}
    return cfg


def test_text_only_multi_image_and_video_records_train_in_one_run(tmp_path, tiny_tokenizer_dir):
    """train.py on 2 processes, ZeRO-3 and FSDP2, one sample per micro-batch: ranks often hold a text-only
    sample while the other holds images, and validation generates for every kind of record."""
    jobs = {}
    for runner in ("runner_deepspeed", "runner_fsdp"):
        out = tmp_path / runner
        cfg = write_yaml(tmp_path / f"{runner}.yaml", _run_config(out, tmp_path / "data", tiny_tokenizer_dir, runner))
        jobs[runner] = (out, start(cfg, nproc=2))
    for runner, (out, job) in jobs.items():
        assert job.wait(timeout=600) == 0, output_of(job)[-4000:]
        steps = train_steps(out)
        assert [m["step"] for m in steps] == list(range(1, 9))  # 16 records, 1 per micro-batch, 2 processes
        assert all(np.isfinite(m["loss"]) and m["loss"] > 0 for m in steps)
        val = [m for m in metrics(out) if m.get("split") == "val"]
        assert len(val) == 1 and val[0]["num_samples"] == 16
        lines = [json.loads(line) for line in (out / "predictions" / "val_step8.jsonl").read_text().splitlines()]
        assert {line["image"] for line in lines} == {None, MIX665K_SINGLE_IMAGE["image"],
                                                     ", ".join(LLAVA_MULTI_IMAGE["image"]), MPP_VIDEO["video"]}
        assert all(isinstance(line["generated"], str) for line in lines)
