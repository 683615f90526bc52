"""A published Qwen2-VL / Qwen2.5-VL folder (tiny, random, written by transformers with its tokenizer, chat template
and processor) loaded by the YAML users write (``arch``, ``load_pretrained: true``, ``pretrained: FOLDER``) through
the family record: the prompt is the processor's token for token (a video's placeholders its <|video_pad|>), the
logits equal transformers' (fp32, 1e-5) on images of three aspect ratios, two images, a video (its frames through
lavis_ds's own processing, timed by the file's rate) and text only, and greedy generation gives the same tokens."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import lavis_ds  # noqa: F401  (fills the registries)
from conftest import TINY_CORPUS
from lavis_ds.common.registry import processors, registry
from lavis_ds.models.image_tokens import GRID_KEY, SECONDS_KEY, video_flags
from lavis_ds.models.parts import PartError
from qwen_vl_folders import published_folder, qwen_tokenizer

KINDS = ["qwen2_vl", "qwen2_5_vl"]
QUESTION, ANSWER = "What is in the picture?", "A red ball on the grass."
# (height, width) px of each image; a video is six frames of one size at 1.5 fps (Qwen2.5-VL spaces its temporal ids
# by that rate: 0, 2, 5 with the folder's tokens_per_second 2; the 24 fps assumed without one would give 0, 0, 0).
# Beyond 112 px the Qwen2.5-VL tower's windows split an image.
CASES = {"wide image": [(90, 200)], "tall image": [(200, 90)], "square image": [(120, 120)],
         "two images": [(70, 100), (150, 60)], "video": "video", "text only": []}


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def user_yaml(kind: str, folder) -> dict:
    """What a user writes, merged over the architecture's first preset as the config loader merges it."""
    cls = registry.get_model_class(kind)
    return {**cls.default_config(next(iter(cls.PRETRAINED_MODEL_CONFIG_DICT))), "arch": kind,
            "load_pretrained": True, "pretrained": str(folder)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Per kind: transformers' model and processor, and lavis_ds's model loaded from their folder."""
    made = {}

    def get(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            theirs, processor = published_folder(kind, TINY_CORPUS, folder)
            ours = registry.get_model_class(kind).from_config(user_yaml(kind, folder)).eval()
            made[kind] = theirs, processor, ours, folder
        return made[kind]
    return get


VIDEO_FRAMES, VIDEO_FPS = 6, 1.5


def inputs_of(processor, case, answer: str | None, ours=None):
    """transformers' inputs for one conversation, and the same sample as a lavis_ds batch: the images as
    transformers' processor makes them, a video's frames through lavis_ds's own processing (``ours``' tower's) with
    the rate of the file they came from."""
    from transformers.video_utils import VideoMetadata

    content, images, videos, kwargs = [], [], [], {}
    if case == "video":
        frames = [picture(84, 112, seed) for seed in range(VIDEO_FRAMES)]
        content.append({"type": "video"})
        videos.append(np.stack([np.asarray(frame) for frame in frames]))
    else:
        for i, (h, w) in enumerate(case):
            content.append({"type": "image"})
            images.append(picture(h, w, i))
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    text = processor.apply_chat_template(messages, add_generation_prompt=answer is None, tokenize=False)
    if videos:  # every frame of a 1.5 fps file: transformers' sampled_fps is the file's rate
        metadata = VideoMetadata(total_num_frames=VIDEO_FRAMES, fps=VIDEO_FPS, frames_indices=list(range(VIDEO_FRAMES)))
        kwargs = {"videos": videos, "video_metadata": [metadata], "do_sample_frames": False}
    inputs = processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
    sample = {"instruction": [["<ImageHere>" * len(content) + QUESTION]], "num_images": [len(content)]}
    if answer is not None:
        sample["output"] = [[answer]]
    if images:
        sample.update(image=inputs["pixel_values"], **{GRID_KEY: inputs["image_grid_thw"]})
    if videos:
        own = processors.get("qwen_vl_image")(**ours.vision_tower.processing.processor_keys())
        sample.update(own.sample_fields(frames, video=True, fps=VIDEO_FPS))
        torch.testing.assert_close(sample["image"], inputs["pixel_values_videos"], atol=0, rtol=0)
        assert sample[GRID_KEY].tolist() == inputs["video_grid_thw"].tolist()
        if "second_per_grid_ts" in inputs:  # Qwen2.5-VL's processor
            assert sample[SECONDS_KEY] == pytest.approx(inputs["second_per_grid_ts"].tolist())
    return inputs, sample


def same_ids(ours: torch.Tensor, theirs: torch.Tensor, processor) -> None:
    """Token for token: an image's placeholders <|image_pad|>, a video's <|video_pad|>, as the processor writes."""
    assert ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(kind, case, pair):
    theirs, processor, ours, _ = pair(kind)
    inputs, sample = inputs_of(processor, CASES[case], ANSWER, ours)
    prepared = ours.prepare_batch(sample)
    same_ids(prepared["input_ids"][0], inputs["input_ids"][0], processor)
    with torch.no_grad():
        expected = theirs(**inputs).logits
        embeds, layout, _ = ours._inputs(prepared, None)
        logits = ours.llm_model(inputs_embeds=embeds, **layout).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["two images", "video", "text only"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_transformers(kind, case, pair):
    theirs, processor, ours, _ = pair(kind)
    inputs, sample = inputs_of(processor, CASES[case], None, ours)
    ids = ours.llm.prompt.generation_prompt(sample["instruction"][0], (), sample["num_images"][0],
                                        ours.image_path.layout.counts(sample), videos=video_flags(sample))
    same_ids(torch.tensor(ids), inputs["input_ids"][0], processor)
    steps = dict(max_new_tokens=6, min_new_tokens=6)
    answer = ours.generate(sample, **steps)
    with torch.no_grad():
        new = theirs.generate(**inputs, do_sample=False, eos_token_id=ours.llm.stop_token_ids(),
                              suppress_tokens=ours.llm.prompt.placeholder_ids,
                              **steps)[0, inputs["input_ids"].shape[1]:]
    assert answer == [processor.tokenizer.decode(new, skip_special_tokens=True).strip()]


def test_the_module_layout_loads_the_same_weights(pair, tmp_path):
    """transformers 5's module names (model.visual.*, model.language_model.*) read as the Hub's layout does."""
    _, _, hub, _ = pair("qwen2_vl")
    published_folder("qwen2_vl", TINY_CORPUS, tmp_path, layout="modules")
    modules = registry.get_model_class("qwen2_vl").from_config(user_yaml("qwen2_vl", tmp_path))
    theirs = modules.state_dict()
    assert all(torch.equal(value, theirs[key]) for key, value in hub.state_dict().items())


def test_a_folder_of_the_other_family_is_refused_naming_it(pair):
    _, _, _, folder = pair("qwen2_vl")
    with pytest.raises(PartError, match=r"is a Qwen2VLForConditionalGeneration folder \(config.json model_type "
                                        r"'qwen2_vl'\), but the model's vision tower is 'qwen2_5_vl'; load it with "
                                        r"model.arch: qwen2_vl"):
        registry.get_model_class("qwen2_5_vl").from_config(user_yaml("qwen2_5_vl", folder))


def test_a_chat_template_without_the_vision_tokens_is_refused(pair, tmp_path):
    _, _, _, folder = pair("qwen2_vl")
    shutil.copytree(folder, tmp_path / "folder")
    chatml = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    qwen_tokenizer(TINY_CORPUS, tmp_path / "tokenizer", template=chatml).save_pretrained(tmp_path / "tokenizer")
    section = {**user_yaml("qwen2_vl", tmp_path / "folder"), "tokenizer": str(tmp_path / "tokenizer")}
    with pytest.raises(PartError, match=r"model.tokenizer: the chat template of .*tokenizer does not write "
                                        r"<\|vision_start\|>, <\|image_pad\|>, <\|vision_end\|>"):
        registry.get_model_class("qwen2_vl").from_config(section)
