"""Qwen3.5 (``qwen3_5``): a tiny published ``Qwen3_5ForConditionalGeneration`` folder (random, written by transformers
with a tokenizer of Qwen3.5's special tokens, its published chat template and the processor) loaded by the YAML users
write: logits equal transformers' (fp32, 1e-5) on two aspect ratios, two images, text only and a video (Qwen3-VL's
frame groups after their timestamps), greedy tokens are the same, and ``--format hf`` writes a folder that
transformers alone reloads and generates the same tokens from. The tiny preset packs equal to padded (loss and
gradients) with images of different grids, each sample's Gated-DeltaNet state starting afresh; DeepStack settings
and a folder of the other family (Qwen3-VL) are one line."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from archs import build_tiny
from families import tokenizer_dir
from lavis_ds.common.registry import processors, registry
from lavis_ds.models.image_tokens import GRID_KEY
from lavis_ds.models.linear_attention import Qwen3_5TextForCausalLM
from lavis_ds.models.parts import PartError
from test_qwen3_vl import (ANSWER, PIXELS, QUESTION, assert_same_gradients, assert_same_ids_and_logits,
                           packed_and_padded, picture, user_yaml, video_inputs_of)
from test_qwen3_vl import published_folder as qwen3_vl_folder

CASES = {"wide image": [(90, 200)], "tall image": [(200, 90)], "two images": [(70, 100), (150, 60)],
         "text only": []}
# The tower without DeepStack; the text model's rotary half of each 16-wide head interleaves t, h, w ([2, 1, 1]).
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, num_position_embeddings=16,
              out_hidden_size=64)
THINKING_OFF = {"enable_thinking": False}  # the 9b preset's chat_template_kwargs, which user_yaml merges in


def published_folder(folder):
    """A random tiny Qwen3.5 saved with its tokenizer and processor, as transformers writes them."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(folder, "qwen3.5"))
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, layer_types=["linear_attention",
                "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                vocab_size=len(tokenizer), max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(vision_config=VISION, text_config=text,
                                                          tie_word_embeddings=False, **ids)).eval()
    with torch.no_grad():  # norms and biases random too: a key mapped to the wrong place shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    video = Qwen3VLVideoProcessor(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**PIXELS), tokenizer=tokenizer,
                                 video_processor=video, chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    return model, processor


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' model and processor, lavis_ds's model loaded from their folder, the folder."""
    folder = tmp_path_factory.mktemp("qwen3_5")
    theirs, processor = published_folder(folder)
    ours = registry.get_model_class("qwen3_5").from_config(user_yaml("qwen3_5", folder)).eval()
    return theirs, processor, ours, folder


def inputs_of(processor, images: list[tuple[int, int]], answer: str | None, variables: dict = THINKING_OFF):
    """transformers' inputs for one conversation (thinking off), and the same sample as a lavis_ds batch."""
    pictures = [picture(h, w, i) for i, (h, w) in enumerate(images)]
    messages = [{"role": "user", "content": [{"type": "image"} for _ in pictures] + [{"type": "text",
                                                                                      "text": QUESTION}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    text = processor.apply_chat_template(messages, add_generation_prompt=answer is None, tokenize=False,
                                         **variables)
    inputs = processor(text=[text], images=pictures or None, return_tensors="pt")
    sample = {"instruction": [["<ImageHere>" * len(pictures) + QUESTION]], "num_images": [len(pictures)]}
    if answer is not None:
        sample["output"] = [[answer]]
    if pictures:
        sample.update(image=inputs["pixel_values"], **{GRID_KEY: inputs["image_grid_thw"]})
    return inputs, sample


def test_the_folder_loads_into_qwen3_5s_parts(pair):
    _, _, ours, _ = pair
    assert isinstance(ours.llm_model, Qwen3_5TextForCausalLM) and ours.connector.deepstack_taps == 0
    assert ours.vision_tower.tap_layers == () and ours.llm.positions.rows == 3


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case, pair):
    theirs, processor, ours, _ = pair
    inputs, sample = inputs_of(processor, CASES[case], ANSWER)
    assert_same_ids_and_logits(theirs, ours, inputs, sample)


def test_a_video_takes_transformers_ids_and_logits(pair):
    """Qwen3-VL's video layout (each frame group after its timestamp text) under Qwen3.5's text model."""
    theirs, processor, ours, _ = pair
    inputs, sample = video_inputs_of(processor, ANSWER, ours, THINKING_OFF)
    assert_same_ids_and_logits(theirs, ours, inputs, sample)


@pytest.mark.parametrize("case", ["two images", "text only"])
def test_greedy_tokens_equal_transformers(case, pair):
    theirs, processor, ours, _ = pair
    inputs, sample = inputs_of(processor, CASES[case], None)
    steps = dict(max_new_tokens=4, min_new_tokens=4)
    answer = ours.generate(sample, **steps)
    with torch.no_grad():
        new = theirs.generate(**inputs, do_sample=False, eos_token_id=ours.llm.stop_token_ids(),
                              suppress_tokens=[ours.llm.prompt.image_token_id],
                              **steps)[0, inputs["input_ids"].shape[1]:]
    assert answer == [processor.tokenizer.decode(new, skip_special_tokens=True).strip()]


def test_the_hf_export_reloads_under_transformers_alone_and_generates_the_same_tokens(pair, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lavis_ds.apps.export_hf import write_hf_folder

    _, _, ours, _ = pair
    assert write_hf_folder(ours, tmp_path) == []  # fp32, nothing computed otherwise
    theirs = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    processor = AutoProcessor.from_pretrained(tmp_path)
    assert type(theirs).__name__ == "Qwen3_5ForConditionalGeneration"
    inputs, sample = inputs_of(processor, CASES["two images"], None, variables={})  # the template's defaults
    assert "<think>\n\n</think>\n\n" in processor.tokenizer.decode(inputs["input_ids"][0])
    mine = processors.get("qwen_vl_image")(**ours.vision_tower.processing.processor_keys())
    pictures = [picture(h, w, i) for i, (h, w) in enumerate(CASES["two images"])]
    torch.testing.assert_close(inputs["pixel_values"], mine.sample_fields(pictures)["image"], atol=0, rtol=0)
    steps = dict(max_new_tokens=6, min_new_tokens=6)
    new = theirs.generate(**inputs, **steps)[0, inputs["input_ids"].shape[1]:]
    assert ours.generate(sample, **steps) == [processor.tokenizer.decode(new, skip_special_tokens=True).strip()]


def test_packed_equals_padded_with_images_of_different_grids(tiny_tokenizer_dir, tmp_path):
    packed, (loss_a, grads_a), (loss_b, grads_b) = packed_and_padded("qwen3_5", tiny_tokenizer_dir, tmp_path)
    assert any(len(spans) > 2 for spans in packed["row_spans"])  # a row holds several samples
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and any("linear_attn.conv1d" in n for n in grads_a)
    assert_same_gradients(grads_a, grads_b)


# ----------------------------------------------------------------- bad input, one line each
@pytest.mark.parametrize("setting,message", [
    ({"vision_tower": {"vision_config": {"deepstack_visual_indexes": [0, 1]}}, "connector": {"deepstack_taps": 2}},
     r"model.vision_tower.vision_config.deepstack_visual_indexes: \[0, 1\]; Qwen3.5 has no DeepStack .* valid: \[\]"),
    ({"connector": {"deepstack_taps": 1}}, r"model.connector.deepstack_taps: 1; Qwen3.5 has no DeepStack mergers; "
                                           r"valid: 0")])
def test_deepstack_settings_are_refused_naming_them(setting, message, tiny_tokenizer_dir, tmp_path):
    with pytest.raises(PartError, match=message):
        build_tiny("qwen3_5", tiny_tokenizer_dir, tmp_path, **setting)


def test_a_qwen3_vl_folder_configured_as_qwen3_5_is_refused_naming_it(tmp_path):
    qwen3_vl_folder(tmp_path)
    with pytest.raises(PartError, match=r"is a Qwen3VLForConditionalGeneration folder \(config.json model_type "
                                        r"'qwen3_vl'\), but model.arch is 'qwen3_5'; load it with model.arch: "
                                        r"qwen3_vl"):
        registry.get_model_class("qwen3_5").from_config(user_yaml("qwen3_5", tmp_path))


def test_a_qwen3_5_folder_configured_as_qwen3_vl_is_refused_naming_it(pair):
    _, _, _, folder = pair
    with pytest.raises(PartError, match=r"is a Qwen3_5ForConditionalGeneration folder \(config.json model_type "
                                        r"'qwen3_5'\), but model.arch is 'qwen3_vl'; load it with model.arch: "
                                        r"qwen3_5"):
        registry.get_model_class("qwen3_vl").from_config(user_yaml("qwen3_vl", folder))
