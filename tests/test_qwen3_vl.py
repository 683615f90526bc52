"""Qwen3-VL (``qwen3_vl``): a tiny published ``Qwen3VLForConditionalGeneration`` folder (random, written by
transformers with its tokenizer, chat template and processor) loaded by the YAML users write: the tower and its
DeepStack mergers equal transformers' vision model, the logits equal transformers' (fp32, 1e-5) on images of
three aspect ratios, two images, text only and a video (each frame group after its timestamp text), greedy tokens
are the same, and ``--format hf`` writes a folder that
transformers alone reloads and generates the same tokens from. The tiny preset packs equal to padded (loss and
gradients) with images of different grids; bad DeepStack settings and a folder of another family are one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from archs import build_tiny, loss_and_grads, tiny_model_section
from conftest import TINY_CORPUS, demo_storage_fixture
from lavis_ds.common.errors import ConfigError, LavisDsError
from lavis_ds.config import load_config
from lavis_ds.common.registry import processors, registry, vision_towers
from lavis_ds.models.image_tokens import GRID_KEY, SECONDS_KEY
from lavis_ds.models.parts import PartError
from lavis_ds.models.settings.base import model_settings
from qwen_vl_folders import QWEN2_VL_TEMPLATE, qwen_tokenizer
from run_utils import tiny_config, write_yaml

QUESTION, ANSWER = "What is in the picture?", "A red ball on the grass."
# (height, width) px of each image: 32 px per merged token, 48 LLM tokens at most
CASES = {"wide image": [(90, 200)], "tall image": [(200, 90)], "square image": [(120, 120)],
         "two images": [(70, 100), (150, 60)], "text only": []}
PIXELS = dict(min_pixels=64 * 64, max_pixels=32 * 32 * 48, patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
# The folder's video processor: a video's frames together within 4096 px .. 48 merged tokens x 6 frames (the video
# below keeps its size; not the published folders' budget, so that the loaded tower shows it read the folder's)
VIDEO_BUDGET = {"shortest_edge": 4096, "longest_edge": 32 * 32 * 48 * 6}
# DeepStack taps after blocks 0 and 2 of 3, added after the text model's layers 0 and 1 (of 2)
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 2], out_hidden_size=64)


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def published_folder(folder):
    """A random tiny Qwen3-VL saved with its tokenizer and processor, as transformers writes them."""
    tokenizer = qwen_tokenizer(TINY_CORPUS, folder)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=VISION, text_config=text,
                                                          tie_word_embeddings=False, **ids)).eval()
    with torch.no_grad():  # norms and biases random too: a key mapped to the wrong place shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    video = Qwen3VLVideoProcessor(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, size=VIDEO_BUDGET)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**PIXELS), tokenizer=tokenizer,
                                 video_processor=video, chat_template=QWEN2_VL_TEMPLATE)
    processor.save_pretrained(folder)
    return model, processor


def user_yaml(arch: str, folder) -> dict:
    """What a user writes, merged over the architecture's first preset as the config loader merges it."""
    cls = registry.get_model_class(arch)
    return {**cls.default_config(next(iter(cls.PRETRAINED_MODEL_CONFIG_DICT))), "arch": arch,
            "load_pretrained": True, "pretrained": str(folder)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' model and processor, lavis_ds's model loaded from their folder, the folder."""
    folder = tmp_path_factory.mktemp("qwen3_vl")
    theirs, processor = published_folder(folder)
    ours = registry.get_model_class("qwen3_vl").from_config(user_yaml("qwen3_vl", folder)).eval()
    return theirs, processor, ours, folder


def inputs_of(processor, images: list[tuple[int, int]], answer: str | None):
    """transformers' inputs for one conversation, and the same sample as a lavis_ds batch."""
    pictures = [picture(h, w, i) for i, (h, w) in enumerate(images)]
    content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    text = processor.apply_chat_template(messages, add_generation_prompt=answer is None, tokenize=False)
    inputs = processor(text=[text], images=pictures or None, return_tensors="pt")
    sample = {"instruction": [["<ImageHere>" * len(pictures) + QUESTION]], "num_images": [len(pictures)]}
    if answer is not None:
        sample["output"] = [[answer]]
    if pictures:
        sample.update(image=inputs["pixel_values"], **{GRID_KEY: inputs["image_grid_thw"]})
    return inputs, sample


# A video: six 64x96 px frames of a 1.5 fps file, every frame taken: three frame groups at 0.3, 1.7 and 3.0 s
VIDEO_FRAMES, VIDEO_FPS, VIDEO_SIZE = 6, 1.5, (64, 96)


def video_inputs_of(processor, answer: str | None, ours=None, variables: dict | None = None):
    """transformers' inputs for one conversation about a video (its frames as given: no sampling; sized by the
    video processor's pixel budget for the whole video),
    and the same sample as a lavis_ds batch: the processor's patches and grid, the file's seconds per frame group
    (``ours``: the frames through lavis_ds's own processing, checked equal). ``variables``: chat-template ones."""
    from transformers.video_utils import VideoMetadata

    frames = np.stack([np.asarray(picture(*VIDEO_SIZE, seed)) for seed in range(VIDEO_FRAMES)])
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    text = processor.apply_chat_template(messages, add_generation_prompt=answer is None, tokenize=False,
                                         **(variables or {}))
    metadata = VideoMetadata(total_num_frames=VIDEO_FRAMES, fps=VIDEO_FPS, frames_indices=list(range(VIDEO_FRAMES)))
    inputs = processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                       cap_pixels_per_frame=False, return_tensors="pt")
    sample = {"instruction": [["<ImageHere>" + QUESTION]], "num_images": [1], "image": inputs["pixel_values_videos"],
              GRID_KEY: inputs["video_grid_thw"], SECONDS_KEY: [2 / VIDEO_FPS]}
    if ours is not None:  # the frames through lavis_ds's own processing, timed by the file's rate: the same fields
        own = processors.get("qwen_vl_image")(**ours.vision_tower.processing.processor_keys())
        fields = own.sample_fields([Image.fromarray(frame) for frame in frames], video=True, fps=VIDEO_FPS)
        torch.testing.assert_close(fields["image"], sample["image"], atol=0, rtol=0)
        assert fields[GRID_KEY].tolist() == sample[GRID_KEY].tolist() and fields[SECONDS_KEY] == sample[SECONDS_KEY]
        sample.update(fields)
    if answer is not None:
        sample["output"] = [[answer]]
    return inputs, sample


@pytest.mark.parametrize("fps", [0.5, 1.5, 2.0, 23.976, 29.97, 30.0])
def test_frame_group_times_are_the_processors(fps):
    """The seconds lavis_ds writes from a video's second_per_grid_t (2 / its sampled rate) are the text Qwen3-VL's
    processor writes from every frame's index and the rate, to the decimal."""
    from lavis_ds.models.frame_groups import frame_group_seconds

    frames = 64
    theirs = Qwen3VLProcessor._calculate_timestamps(None, list(range(frames)), fps, 2)
    ours = frame_group_seconds(frames // 2, 2 / fps, 2)
    assert [f"{t:.1f}" for t in ours] == [f"{t:.1f}" for t in theirs]


def test_the_datasets_processor_is_filled_with_the_folders_processing(pair):
    """The config loader fills a dataset's ``qwen_vl_image`` from the folder's processors (image pixel bounds, the
    video budget), the processing the model is built with, not the tower's defaults."""
    from omegaconf import OmegaConf

    from lavis_ds.datasets.processor_sections import build_processor
    from lavis_ds.image_config import fill_tower_processing

    _, _, ours, folder = pair
    cfg = OmegaConf.create({"model": user_yaml("qwen3_vl", folder),
                            "datasets": {"clips": {"vis_processor": {"train": {"name": "qwen_vl_image"}}}}})
    fill_tower_processing(cfg, registry.get_model_class("qwen3_vl"))
    filled = build_processor(cfg.datasets.clips.vis_processor.train).processing
    assert filled == ours.vision_tower.processing
    assert (filled.min_pixels, filled.max_pixels, filled.video_max_pixels) == (
        PIXELS["min_pixels"], PIXELS["max_pixels"], VIDEO_BUDGET["longest_edge"])


def test_a_video_takes_transformers_ids_and_logits(pair):
    from lavis_ds.models.vision_llm_batch import token_batch

    theirs, processor, ours, folder = pair
    inputs, sample = video_inputs_of(processor, ANSWER, ours)
    assert inputs["video_grid_thw"].tolist() == [[3, 4, 6]]
    processing = ours.vision_tower.processing  # the folder's video processor's sampling, as loaded
    assert (processing.video_fps, processing.video_min_pixels, processing.video_max_pixels) == (
        2, VIDEO_BUDGET["shortest_edge"], VIDEO_BUDGET["longest_edge"])
    text = processor.tokenizer.decode(inputs["input_ids"][0])
    assert "<0.3 seconds><|vision_start|>" in text and "<3.0 seconds>" in text  # the layout under test
    assert_same_ids_and_logits(theirs, ours, inputs, sample)
    # show_sample's ids, from the prompt the model section builds without weights, are the same
    weightless = model_settings(type(ours), user_yaml("qwen3_vl", folder)).prompt()
    shown = token_batch(weightless, sample, ours.llm.pad_id, tokens_for_image=ours.image_path.layout.tokens_for_image)
    assert shown["input_ids"][0].tolist() == inputs["input_ids"][0].tolist()


def test_a_video_generates_transformers_tokens(pair):
    theirs, processor, ours, _ = pair
    inputs, sample = video_inputs_of(processor, None)
    steps = dict(max_new_tokens=4, min_new_tokens=4)
    answer = ours.generate(sample, **steps)
    with torch.no_grad():
        new = theirs.generate(**inputs, do_sample=False, eos_token_id=ours.llm.stop_token_ids(),
                              suppress_tokens=ours.llm.prompt.placeholder_ids,
                              **steps)[0, inputs["input_ids"].shape[1]:]
    assert answer == [processor.tokenizer.decode(new, skip_special_tokens=True).strip()]


def test_the_tower_and_its_mergers_equal_transformers_vision_model(pair):
    theirs, processor, ours, _ = pair
    inputs, sample = inputs_of(processor, CASES["two images"] + CASES["tall image"], None)
    grid = inputs["image_grid_thw"]
    with torch.no_grad():
        expected = theirs.model.visual(inputs["pixel_values"], grid_thw=grid)
        features = ours.image_path.encode(sample["image"], sample)
    hidden = ours.llm.config.hidden_size
    merged, *deepstack = features.split(hidden, dim=-1)
    assert len(deepstack) == len(expected.deepstack_features) == 2
    torch.testing.assert_close(merged, expected.pooler_output, atol=1e-5, rtol=0)
    for mine, reference in zip(deepstack, expected.deepstack_features):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case, pair):
    theirs, processor, ours, _ = pair
    inputs, sample = inputs_of(processor, CASES[case], ANSWER)
    layout = assert_same_ids_and_logits(theirs, ours, inputs, sample)
    assert ("deepstack_visual_embeds" in layout) == bool(CASES[case])


@pytest.mark.parametrize("case,beams", [("two images", 1), ("two images", 2), ("text only", 1)])
def test_generated_tokens_equal_transformers(case, beams, pair):
    """Greedy, and beam search (each copy of the prompt takes its DeepStack features)."""
    theirs, processor, ours, _ = pair
    inputs, sample = inputs_of(processor, CASES[case], None)
    steps = dict(max_new_tokens=4, min_new_tokens=4, num_beams=beams)
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
    assert type(theirs).__name__ == "Qwen3VLForConditionalGeneration"
    pictures = [picture(h, w, i) for i, (h, w) in enumerate(CASES["two images"])]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    mine = processors.get("qwen_vl_image")(**ours.vision_tower.processing.processor_keys())
    sample = {"instruction": [["<ImageHere><ImageHere>What is it?"]], "num_images": [2], **mine.sample_fields(pictures)}
    torch.testing.assert_close(inputs["pixel_values"], sample["image"], atol=0, rtol=0)
    steps = dict(max_new_tokens=6, min_new_tokens=6)
    new = theirs.generate(**inputs, **steps)[0, inputs["input_ids"].shape[1]:]
    assert ours.generate(sample, **steps) == [processor.tokenizer.decode(new, skip_special_tokens=True).strip()]


def packed_and_padded(arch: str, tiny_tokenizer_dir, tmp_path) -> tuple[dict, tuple, tuple]:
    """The tiny ``arch`` on four samples of 0, 2, 1 and 1 images of four grids, padded and packed into rows that
    reorder them: the packed batch, then (loss, gradients) padded and packed."""
    torch.manual_seed(0)
    model = build_tiny(arch, tiny_tokenizer_dir, tmp_path).eval()
    mine = processors.get("qwen_vl_image")(**model.vision_tower.processing.processor_keys())
    sizes = [[], [(150, 70), (60, 130)], [(180, 170)], [(64, 64)]]
    fields = mine.sample_fields([picture(h, w, i) for i, (h, w) in enumerate(s for one in sizes for s in one)])
    batch = {"image": fields["image"], GRID_KEY: fields[GRID_KEY], "num_images": [len(s) for s in sizes],
             "instruction": [["<ImageHere>" * len(s) + q] for s, q in zip(sizes, ["Hi.", "Same?", "What?", "Colour?"])],
             "output": [["Hello."], ["No, one is wider."], ["A square."], ["Red."]]}
    padded, loss_a, grads_a = loss_and_grads(model, batch, None)
    longest = int(padded["attention_mask"].sum(1).max())
    row = next(n for n in range(longest, 3 * longest)
               if model.prepare_batch(dict(batch), pack_to=n)["order"] != [0, 1, 2, 3])
    packed, loss_b, grads_b = loss_and_grads(model, batch, row)
    assert packed["input_ids"].shape[0] < 4 and len({tuple(g) for g in fields[GRID_KEY].tolist()}) == 4
    return packed, (loss_a, grads_a), (loss_b, grads_b)


def assert_same_ids_and_logits(theirs, ours, inputs: dict, sample: dict) -> dict:
    """lavis_ds's prompt ids equal the processor's, and its logits transformers' (fp32, 1e-5); the LLM's inputs
    besides the embeddings (positions, DeepStack features) that lavis_ds laid out, for further checks."""
    prepared = ours.prepare_batch(sample)
    assert prepared["input_ids"][0].tolist() == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = theirs(**inputs).logits
        embeds, layout, _ = ours._inputs(prepared, None)
        logits = ours.llm_model(inputs_embeds=embeds, **layout).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    return layout


def assert_same_gradients(grads_a: dict, grads_b: dict) -> None:
    """Each parameter's gradient equal to 1e-6 of its norm (plus 1e-7 of all of them)."""
    whole = torch.cat([g.flatten() for g in grads_a.values()]).norm()
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-7 * whole, name


def test_packed_equals_padded_with_images_of_different_grids(tiny_tokenizer_dir, tmp_path):
    _, (loss_a, grads_a), (loss_b, grads_b) = packed_and_padded("qwen3_vl", tiny_tokenizer_dir, tmp_path)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and any("deepstack_merger_list" in n for n in grads_a)
    assert_same_gradients(grads_a, grads_b)


def test_packed_equals_padded_with_a_video_and_an_image(tiny_tokenizer_dir, tmp_path):
    """Each frame group's positions and DeepStack rows follow its sample into the packed row."""
    torch.manual_seed(0)
    model = build_tiny("qwen3_vl", tiny_tokenizer_dir, tmp_path).eval()
    mine = processors.get("qwen_vl_image")(**model.vision_tower.processing.processor_keys())
    video = mine.sample_fields([picture(*VIDEO_SIZE, seed) for seed in range(4)], video=True, fps=VIDEO_FPS)
    still = mine.sample_fields([picture(96, 64, 9)])
    batch = {"image": torch.cat([video["image"], still["image"]]), GRID_KEY: torch.cat([video[GRID_KEY],
             still[GRID_KEY]]), SECONDS_KEY: video[SECONDS_KEY] + still[SECONDS_KEY], "num_images": [1, 1],
             "instruction": [["<ImageHere>What happens?"], ["<ImageHere>Colour?"]],
             "output": [["A ball rolls."], ["Red."]]}
    padded, loss_a, grads_a = loss_and_grads(model, batch, None)
    packed, loss_b, grads_b = loss_and_grads(model, batch, int(padded["attention_mask"].sum()))
    assert packed["input_ids"].shape[0] == 1
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    whole = torch.cat([g.flatten() for g in grads_a.values()]).norm()
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-7 * whole, name


# ----------------------------------------------------------------- bad input, one line each
def test_a_deepstack_index_beyond_the_towers_blocks_is_named():
    with pytest.raises(PartError, match=r"vision_tower.vision_config.deepstack_visual_indexes: \[0, 3\]; valid: "
                                        r"increasing block indexes of the 3 blocks \(0..2\)"):
        vision_towers.get("qwen3_vl")(preset="tiny", vision_config={"deepstack_visual_indexes": [0, 3]})


def test_more_deepstack_taps_than_llm_layers_are_named(tiny_tokenizer_dir, tmp_path):
    with pytest.raises(PartError, match=r"deepstack_visual_indexes: \[0, 1\] feed the LLM after its first 2 decoder "
                                        r"layers, but it has 1; valid: at most 1 taps"):
        build_tiny("qwen3_vl", tiny_tokenizer_dir, tmp_path, llm_config={"num_hidden_layers": 1})


def test_deepstack_mergers_that_do_not_match_the_taps_are_named(tiny_tokenizer_dir, tmp_path):
    with pytest.raises(PartError, match=r"model.connector.deepstack_taps: 3 DeepStack mergers, but the tower taps 2 "
                                        r"blocks .*; valid: 2"):
        build_tiny("qwen3_vl", tiny_tokenizer_dir, tmp_path, connector={"deepstack_taps": 3})


demo_storage = demo_storage_fixture(num_train=2, num_val=1, num_test=1)
# name: (architecture, the model section's change, the config check's one line)
DEEPSTACK_CASES = {
    "a tap beyond the tower's blocks": (
        "qwen3_vl", {"vision_tower": {"vision_config": {"deepstack_visual_indexes": [0, 3]}}},
        r"model\.vision_tower\.vision_config\.deepstack_visual_indexes: \[0, 3\]; valid: increasing block indexes "
        r"of the 3 blocks \(0\.\.2\), e\.g\. \[8, 16, 24\] of 27"),
    "more taps than the LLM has layers": (
        "qwen3_vl", {"llm_config": {"num_hidden_layers": 1}},
        r"model\.vision_tower\.vision_config\.deepstack_visual_indexes: \[0, 1\] feed the LLM after its first 2 "
        r"decoder layers, but it has 1; valid: at most 1 taps, added after decoder layers 0\.\.0"),
    "mergers that do not match the taps": (
        "qwen3_vl", {"connector": {"deepstack_taps": 1}},
        r"model\.connector\.deepstack_taps: 1 DeepStack mergers, but the tower taps 2 blocks .*; valid: 2"),
    "a tap on Qwen3.5": (
        "qwen3_5", {"vision_tower": {"vision_config": {"deepstack_visual_indexes": [1]}}},
        r"model\.vision_tower\.vision_config\.deepstack_visual_indexes: \[1\]; Qwen3\.5 has no DeepStack .*"
        r"valid: \[\] \(or use model\.arch: qwen3_vl for DeepStack\)"),
}


@pytest.mark.parametrize("case", DEEPSTACK_CASES)
def test_the_config_check_refuses_deepstack_settings_the_build_would(case, demo_storage, tmp_path):
    """What ``lavis-ds train`` checks before it builds anything (load_config): one line naming the key and the
    valid range; the preset itself passes."""
    arch, change, message = DEEPSTACK_CASES[case]
    cfg = tiny_config(tmp_path / "out", demo_storage, micro=2, sizes=(2, 1, 1))
    cfg["model"] = tiny_model_section(arch, demo_storage / "tokenizer", demo_storage)
    load_config(write_yaml(tmp_path / "valid.yaml", cfg))
    cfg["model"] = tiny_model_section(arch, demo_storage / "tokenizer", demo_storage, **change)
    with pytest.raises(ConfigError, match=rf"1 problem\(s\) in \S+:\n  - {message}$"):
        load_config(write_yaml(tmp_path / "run.yaml", cfg))


def test_a_temporal_patch_other_than_qwen3_vls_is_named(tiny_tokenizer_dir, tmp_path):
    with pytest.raises(PartError, match=r"model.vision_tower.vision_config.temporal_patch_size: 3; Qwen3-VL's prompt "
                                        r"times each video frame group as 2 frames; valid: 2"):
        build_tiny("qwen3_vl", tiny_tokenizer_dir, tmp_path, vision_tower={"vision_config": {"temporal_patch_size": 3}})


def test_a_qwen3_vl_folder_configured_as_another_family_is_refused_naming_it(pair):
    _, _, _, folder = pair
    with pytest.raises(PartError, match=r"is a Qwen3VLForConditionalGeneration folder \(config.json model_type "
                                        r"'qwen3_vl'\), but the model's vision tower is 'qwen2_vl'; load it with "
                                        r"model.arch: qwen3_vl"):
        registry.get_model_class("qwen2_vl").from_config(user_yaml("qwen2_vl", folder))


def test_a_video_without_its_seconds_is_refused_naming_it(pair):
    _, _, ours, _ = pair
    sample = {"instruction": [["<ImageHere>What happens?"]], "num_images": [1],
              "image": torch.zeros(2 * 4 * 4, 3 * 2 * 16 * 16), GRID_KEY: torch.tensor([[2, 4, 4]])}
    with pytest.raises(LavisDsError, match=r"qwen3_vl: image 0 of the batch has 2 temporal patches \(image_grid_thw "
                                           r"row \[2, 4, 4\]\) but no second_per_grid_t"):
        ours.generate(sample)
