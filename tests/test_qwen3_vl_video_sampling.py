"""Qwen3-VL's own video sampling: a video record of a Qwen3-VL run whose ``build_info`` gives no ``max_frames`` takes
the frames, pixels and frame-group timestamps transformers' ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor`` take
of the same file (2 frames a second, at least 4; one pixel budget for all of a video's frames), decoded by each
side's own PyAV reader; the token budget counts the same grid from the file's header alone. ``max_frames`` given
(and Qwen2-VL's towers) keep uniform sampling; bad video settings are one line each."""
from __future__ import annotations

import json
import re

import av
import numpy as np
import pytest
import torch
from transformers import Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import load_video

from conftest import TINY_CORPUS
from lavis_ds.common.errors import InputError, LavisDsError
from lavis_ds.common.registry import builders, registry
from lavis_ds.models.frame_groups import frame_group_marks
from lavis_ds.models.settings.base import model_settings
from lavis_ds.processors.qwen_vl import FRAME_SECONDS_KEY, GRID_KEY, SECONDS_KEY, QwenVLImageProcessor, tokens_for_grid
from qwen_vl_folders import QWEN2_VL_TEMPLATE, qwen_tokenizer

SPAN = ("<|vision_start|>", "<|vision_end|>")
# The published Qwen3-VL / Qwen3.5 folders' video_preprocessor_config.json size: the tower's own default budget
PUBLISHED_BUDGET = {"shortest_edge": 4096, "longest_edge": 25165824}
# Qwen3VLVideoProcessor's class defaults (a processor built without a folder), set as the dataset's keys
CLASS_BUDGET = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
# (frames, frames per second, (width, height) px) of each file, and the pixel budget both sides take
VIDEOS = {
    # 3 s: 6 of 30 frames at a fractional stride (0, 6, 12, 17, 23, 29); 6 x 480 x 320 px is over the budget: smaller
    "downscaled, fractional stride": (30, 10, (480, 320), CLASS_BUDGET),
    # 1.75 s: 3 frames at 2 a second, raised to the 4 fewest; under the budget's least area: larger
    "upscaled, fewest frames": (7, 4, (96, 64), CLASS_BUDGET),
    # 4.5 s: 9 frames, the last frame group repeating the last frame; the tower's own budget
    "odd frame count": (45, 10, (160, 120), None),
}


def write_video(path, frames: int, fps: int, size: tuple[int, int]):
    """An MPEG-4 file of random 8 px blocks, other ones every frame (a frame taken in another's place shows)."""
    rng = np.random.default_rng(frames)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            blocks = rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
            pixels = blocks.repeat(8, axis=0).repeat(8, axis=1)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def video_builder(root, processor: dict, **build_info):
    """The ``minigpt4qwen_instruction`` builder of a section with one video record, as a run config gives it."""
    (root / "ann.json").write_text(json.dumps([{"video": "v.mp4", "instruction": "<ImageHere> What happens?",
                                                "output": "A change."}]))
    section = {"build_info": {"annotations": {"train": {"storage": str(root / "ann.json")}},
                              "images": {"storage": str(root)}, **build_info},
               "vis_processor": {"train": processor, "eval": processor}}
    return builders.get("minigpt4qwen_instruction")(section)


def video_dataset(root, processor: dict, **build_info):
    """The builder's training set (``video_builder``)."""
    return video_builder(root, processor, **build_info).build()["train"]


def tower_processor(arch: str) -> dict:
    """The ``qwen_vl_image`` section a run of ``arch``'s tiny preset gets (the keys filled from its tower)."""
    cls = registry.get_model_class(arch)
    processing = model_settings(cls, cls.default_config("tiny")).image_processing()
    return {"name": "qwen_vl_image", **processing.processor_keys()}


@pytest.fixture(scope="module")
def qwen3_vl_processor() -> dict:
    """The ``qwen_vl_image`` section a Qwen3-VL run's datasets get: the keys the config loader fills from the tiny
    preset's tower (its settings' ``image_processing()``): 2 frames a second and the published folders' budget."""
    processor = tower_processor("qwen3_vl")
    assert (processor["video_fps"], processor["video_min_pixels"], processor["video_max_pixels"]) == (
        2, PUBLISHED_BUDGET["shortest_edge"], PUBLISHED_BUDGET["longest_edge"])
    return processor


@pytest.fixture(scope="module")
def transformers_processor(tmp_path_factory):
    """transformers' Qwen3-VL processor (its video processor's sampling defaults: 2 frames a second, 4 to 768)."""
    tokenizer = qwen_tokenizer(TINY_CORPUS, tmp_path_factory.mktemp("tokenizer"))
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16), tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(), chat_template=QWEN2_VL_TEMPLATE)


@pytest.mark.parametrize("case", list(VIDEOS))
def test_video_frames_pixels_and_timestamps_are_transformers(case, tmp_path, qwen3_vl_processor,
                                                             transformers_processor):
    frames, fps, size, budget = VIDEOS[case]
    path = write_video(tmp_path / "v.mp4", frames, fps, size)
    decoded, metadata = load_video(str(path), backend="pyav")  # every frame, and the file's rate
    theirs = transformers_processor.video_processor(
        videos=[decoded], video_metadata=[metadata], do_sample_frames=True, return_metadata=True,
        cap_pixels_per_frame=False, size=budget or PUBLISHED_BUDGET, return_tensors="pt")
    keys = {} if budget is None else {"video_min_pixels": budget["shortest_edge"],
                                      "video_max_pixels": budget["longest_edge"]}
    dataset = video_dataset(tmp_path, {**qwen3_vl_processor, **keys})
    batch = dataset.collater([dataset[0]])
    torch.testing.assert_close(batch["image"], theirs["pixel_values_videos"], atol=0, rtol=0)  # the same frames
    assert batch[GRID_KEY].tolist() == theirs["video_grid_thw"].tolist()
    assert dataset.image_sizes(0) == [tuple(theirs["video_grid_thw"][0].tolist())]  # the header's count, undecoded
    # the frame groups' timestamps and placeholders as Qwen3VLProcessor writes the video into the prompt
    written = transformers_processor.replace_video_token(
        {"video_grid_thw": theirs["video_grid_thw"], "video_metadata": theirs["video_metadata"]}, 0)
    groups = frame_group_marks(batch, 2, SPAN)[0]
    assert groups.run("<|video_pad|>", tokens_for_grid(batch[GRID_KEY][0])) == written


@pytest.mark.parametrize("arch,build_info,frames", [
    ("qwen3_vl", {"max_frames": 4}, 4),  # the config says otherwise: 4 frames, uniformly
    ("qwen2_vl", {}, 32),  # Qwen2-VL's video processor has no rate of its own: 32 frames (max_frames' default)
])
def test_max_frames_given_or_a_tower_without_own_sampling_samples_uniformly(arch, build_info, frames, tmp_path):
    write_video(tmp_path / "v.mp4", 45, 10, (64, 64))
    dataset = video_dataset(tmp_path, tower_processor(arch), **build_info)
    sample = dataset[0]
    assert sample[GRID_KEY][0, 0] == frames // 2 and dataset.image_sizes(0)[0][0] == frames // 2
    step = 44 / (frames - 1)  # the frames' times: uniform over the file's 45 frames at 10 fps
    assert sample[FRAME_SECONDS_KEY][0] == tuple(round(k * step) / 10 for k in range(frames))
    assert sample[SECONDS_KEY][0] == pytest.approx(2 / (frames / 45 * 10))


@pytest.mark.parametrize("arch,keys,message", [
    ("qwen3_vl", {"video_fps": 0}, r"video_fps: 0; valid: frames per second above 0 \(Qwen3-VL's 2\), or null for "
                                   r"the dataset's max_frames"),
    ("qwen3_vl", {"video_min_frames": 8, "video_max_frames": 4},
     r"video_min_frames 8, video_max_frames 4; valid: integers, 1 <= video_min_frames <= video_max_frames"),
    # a tower without a video budget of its own (Qwen2-VL's) leaves the other bound unset
    ("qwen2_vl", {"video_min_pixels": 4096}, r"video_min_pixels 4096, video_max_pixels None; valid: both \(a "
                                             r"video's pixel budget\) or neither"),
    ("qwen3_vl", {"video_min_pixels": 8192, "video_max_pixels": 4096}, r"max_pixels: 4096 is below min_pixels 8192"),
])
def test_bad_video_settings(arch, keys, message, tmp_path):
    """Each one problem line of the config check, naming the dataset's processor section."""
    write_video(tmp_path / "v.mp4", 8, 4, (64, 64))
    problems = video_builder(tmp_path, {**tower_processor(arch), **keys}).check()
    assert len(problems) == 2, problems  # the train and eval processors
    assert re.fullmatch(r"datasets\.minigpt4qwen_instruction\.vis_processor\.train: Qwen-VL processing.*: " + message
                        + ".*", problems[0]), problems
    with pytest.raises(InputError, match=message):
        QwenVLImageProcessor(**keys)


def test_frame_times_that_do_not_fill_the_grid_are_refused():
    batch = {GRID_KEY: torch.tensor([[2, 2, 2]]), SECONDS_KEY: [1.0], FRAME_SECONDS_KEY: [(0.0, 0.5)]}
    with pytest.raises(LavisDsError, match=r"^video 0 of the batch: 2 frame group\(s\) of 2 frames \(its grid\) but 2 "
                                           r"frame time\(s\) \(video_frame_seconds\); valid: a time for each sampled "
                                           r"frame, 3 to 4$"):
        frame_group_marks(batch, 2, SPAN)
