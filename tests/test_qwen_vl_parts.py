"""The Qwen2-VL / Qwen2.5-VL image path as parts: processing, towers and patch_merger against transformers' own
(tiny random models saved as published folders, fp32), and one clear message per bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as transformers_smart_resize
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

import lavis_ds  # noqa: F401  (fills the registries)
from lavis_ds.common.errors import InputError
from lavis_ds.common.registry import connectors, models, processors, vision_towers
from lavis_ds.datasets.processor_sections import build_processor
from lavis_ds.models.parts import PartError, build_part
from lavis_ds.models.settings.base import model_settings
from lavis_ds.processors.qwen_vl import QwenVLProcessing, sample_frames, smart_resize, tokens_for_grid

TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=160, bos_token_id=None, eos_token_id=None)
VISION = {"qwen2_vl": dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=48),
          "qwen2_5_vl": dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48,
                             fullatt_block_indexes=[1, 3])}
NORM = {"qwen2_vl": "layernorm", "qwen2_5_vl": "rmsnorm"}
# A small max_pixels keeps the images tiny; the sizes cover rounding up and down, upscaling below min_pixels and
# downscaling above max_pixels, images smaller than one merge window (10 x 10, 5 x 40) and long strips.
SMALL = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 48)
SIZES = [(10, 10), (5, 40), (28, 28), (57, 1000), (100, 300), (333, 222), (480, 640), (1000, 40)]


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration, every weight random (norms
    included), saved as save_pretrained writes them (``visual.*``) and in the ``model.visual.*`` layout."""
    root = tmp_path_factory.mktemp("qwen_vl")
    folders = {}
    for kind, (config_class, model_class) in {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
                                              "qwen2_5_vl": (Qwen2_5_VLConfig,
                                                             Qwen2_5_VLForConditionalGeneration)}.items():
        torch.manual_seed(0)
        model = model_class(config_class(vision_config=VISION[kind], text_config=TEXT)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(root / kind)
        state = load_file(root / kind / "model.safetensors")
        assert any(k.startswith("visual.blocks.") for k in state)
        (root / f"{kind}_model").mkdir()
        (root / f"{kind}_model" / "config.json").write_text((root / kind / "config.json").read_text())
        save_file({("model." + k if k.startswith("visual.") else k): v for k, v in state.items()},
                  root / f"{kind}_model" / "model.safetensors", metadata={"format": "pt"})
        folders[kind] = (model.model.visual, root / kind, root / f"{kind}_model")
    return folders


def parts(kind: str, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    tower = build_part(vision_towers, {"name": kind, "preset": "tiny", "pretrained": str(folder), **SMALL},
                       "model.vision_tower").eval()
    merger = build_part(connectors, {"name": "patch_merger", "norm": NORM[kind], "pretrained": str(folder)},
                        "model.connector", vision_width=tower.num_features, llm_width=48).eval()
    return tower, merger


# ----------------------------------------------------------------- processing
def test_processing_gives_transformers_pixels_grids_and_token_counts():
    theirs = Qwen2VLImageProcessor(**SMALL)
    ours = QwenVLProcessing(**SMALL)
    for height, width in SIZES:
        image = random_image(height, width)
        expected = theirs(image, return_tensors="pt")
        got = ours.image(image)
        assert got.grid_thw.tolist() == expected["image_grid_thw"][0].tolist(), (height, width)
        assert torch.equal(got.pixel_values, expected["pixel_values"]), (height, width)
        tokens = theirs.get_number_of_image_patches(height, width) // 4
        assert ours.tokens_for_size(height, width) == tokens_for_grid(got.grid_thw) == tokens, (height, width)
    # an image smaller than one merge window is scaled up to min_pixels, as transformers does (named in the docs)
    assert ours.resized_size(10, 10) == (56, 56) and ours.resized_size(5, 40) == (28, 168)


def test_video_frames_sampled_and_patched_as_transformers_video_processor():
    theirs = Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, cap_pixels_per_frame=False)
    ours = QwenVLProcessing(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    video = torch.randint(0, 256, (13, 3, 90, 120), dtype=torch.uint8)
    for sampling in ({"fps": 2.0}, {"num_frames": 6}, {"num_frames": 5}, {}):
        metadata = VideoMetadata(total_num_frames=13, fps=6.0)
        expected = theirs(videos=[video], video_metadata=[metadata], do_sample_frames=bool(sampling),
                          return_metadata=True, return_tensors="pt", **sampling)
        indices = sample_frames(13, 6.0, fps=sampling.get("fps"), nframes=sampling.get("num_frames"))
        sampled_fps = len(indices) / 13 * 6.0
        got = ours.video([video[i] for i in indices], sampled_fps)
        assert got.grid_thw.tolist() == expected["video_grid_thw"][0].tolist(), sampling
        assert torch.equal(got.pixel_values, expected["pixel_values_videos"]), sampling
        if sampling:  # Qwen2_5_VLProcessor's second_per_grid_ts: temporal_patch_size / the sampled frames' fps
            assert indices == expected["video_metadata"][0].frames_indices.tolist()
            assert got.second_per_grid_t == pytest.approx(2 / expected["video_metadata"][0].sampled_fps)
    assert ours.tokens_for_size(90, 120, frames=13) == tokens_for_grid(ours.video(list(video)).grid_thw)


def test_qwen_vl_image_processor_takes_its_keys_from_the_tower():
    tower = build_part(vision_towers, {"name": "qwen2_5_vl", "preset": "tiny", **SMALL}, "model.vision_tower")
    processor = build_processor({"name": "qwen_vl_image", **tower.processing.processor_keys()})
    assert processors.get("qwen_vl_image").FROM_TOWER and processor.processing == tower.processing
    image = random_image(200, 90)
    visual = processor(image)
    assert torch.equal(visual.pixel_values, tower.processing.image(image).pixel_values)
    assert tower.tokens_for_grid(visual.grid_thw) == tower.tokens_for_size(200, 90) == visual.pixel_values.shape[0] // 4
    assert build_processor({"name": "qwen_vl_image"}).processing == QwenVLProcessing()  # Qwen's published defaults


# ----------------------------------------------------------------- towers and merger
@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("layout", ["visual", "model.visual"])
def test_tower_and_merger_give_transformers_visual_features(published, kind, layout):
    reference, folder, folder_v5 = published[kind]
    tower, merger = parts(kind, folder if layout == "visual" else folder_v5)
    processing = tower.processing
    wide, tall, square = (random_image(130, 500, 1), random_image(600, 150, 2), random_image(200, 200, 3))
    frames = [np.asarray(random_image(200, 260, seed)) for seed in range(4)]
    inputs = [[processing.image(wide)], [processing.image(tall)], [processing.image(square)],
              [processing.image(wide), processing.image(tall)], [processing.video(frames, 2.0)]]
    for visuals in inputs:
        pixels = torch.cat([v.pixel_values for v in visuals])
        grid = torch.stack([v.grid_thw for v in visuals])
        with torch.no_grad():
            features = tower(pixels, grid)
            ours = merger(features)
            theirs = reference(pixels, grid_thw=grid).pooler_output
        assert features.shape == (pixels.shape[0], tower.num_features)
        assert ours.shape[0] == sum(tower.tokens_for_grid(g) for g in grid) == merger.tokens_per_image(len(pixels))
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # the gradient reaching the patches, through every block's spans (two images: several runs of spans)
    pixels = torch.cat([v.pixel_values for v in inputs[3]])
    grid = torch.stack([v.grid_thw for v in inputs[3]])
    weights = torch.randn(pixels.shape[0] // 4, 48)
    grads = []
    for forward in (lambda x: merger(tower(x, grid)), lambda x: reference(x, grid_thw=grid).pooler_output):
        x = pixels.clone().requires_grad_()
        (forward(x) * weights).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)
    grid = torch.stack([v.grid_thw for v in inputs[4]])
    if kind == "qwen2_5_vl":  # windows and frames differ here: the windowed blocks were checked as such
        windows, frames = tower.attention_plan(grid)[1][:2]
        assert grid.tolist() == [[2, 12, 14]] and len(windows) == 8 and frames == [168, 168]
    assert len(tower.blocks()) == len(reference.blocks) and tower.blocks()[0] is tower.blocks[0]


def test_tower_keys_are_transformers_visual_keys_without_the_merger(published):
    for kind, (reference, _, _) in published.items():
        tower = build_part(vision_towers, {"name": kind, "preset": "tiny"}, "t")
        merger = build_part(connectors, {"name": "patch_merger", "norm": NORM[kind]}, "c", vision_width=32,
                            llm_width=48)
        theirs = set(reference.state_dict())
        assert set(tower.state_dict()) == {k for k in theirs if not k.startswith("merger.")}
        assert {f"merger.{k}" for k in merger.state_dict()} == {k for k in theirs if k.startswith("merger.")}


@pytest.mark.parametrize("name,preset", [("qwen2_vl", "2b"), ("qwen2_vl", "7b"), ("qwen2_5_vl", "3b"),
                                         ("qwen2_5_vl", "7b")])
def test_published_presets_are_the_published_towers(name, preset):
    """Each preset's tower has the parameters (names and shapes) of transformers' vision model built from the
    published vision config, the merger apart; both built on the meta device."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    tower_class = vision_towers.get(name)
    arguments = {k: v for k, v in tower_class.SPEC.presets[preset].items() if k != "hub_id"}
    model_class = {"qwen2_vl": Qwen2VisionTransformerPretrainedModel,
                   "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel}[name]
    with torch.device("meta"):
        tower = tower_class(preset=preset)
        reference = model_class(tower_class.SPEC.config_class(**arguments))
    theirs = {k: tuple(v.shape) for k, v in reference.state_dict().items() if not k.startswith("merger.")}
    assert {k: tuple(v.shape) for k, v in tower.state_dict().items()} == theirs
    assert len(tower.blocks()) == 32 and tower.num_features == 1280
    if name == "qwen2_5_vl":
        assert tower.full_attention == {7, 15, 23, 31}


# ----------------------------------------------------------------- bad input, one line each
def test_max_pixels_below_min_pixels():
    with pytest.raises(InputError, match=r"max_pixels: 3136 is below min_pixels 50176; valid: min_pixels <= "
                                         r"max_pixels \(Qwen's defaults: 3136 and 1003520\)"):
        QwenVLProcessing(min_pixels=50176, max_pixels=3136)
    with pytest.raises(PartError, match=r"vision_tower: .*max_pixels: 3136 is below min_pixels 50176"):
        build_part(vision_towers, {"name": "qwen2_vl", "preset": "tiny", "min_pixels": 50176, "max_pixels": 3136},
                   "model.vision_tower")
    with pytest.raises(InputError, match=r"min_pixels: 100; valid: an integer of at least 784 \(28x28 px, one merge "
                                         r"window"):
        build_processor({"name": "qwen_vl_image", "min_pixels": 100})


def test_aspect_ratio_over_200():
    with pytest.raises(InputError, match=r"image of 4020x20 px \(width x height\) has an aspect ratio of 201\.0, over "
                                         r"the 200 Qwen-VL's smart_resize takes: crop or pad it"):
        QwenVLProcessing().image(random_image(20, 4020))
    assert smart_resize(20, 4000) == transformers_smart_resize(20, 4000) == (28, 4004)  # 200:1 is taken


def test_video_with_fewer_frames_than_the_temporal_patch():
    with pytest.raises(InputError, match=r"video of 1 frame\(s\): Qwen-VL takes frames in temporal patches of 2; a "
                                         r"video needs at least 2 frames"):
        QwenVLProcessing().video([random_image(56, 56)])
    with pytest.raises(InputError, match=r"video of 13 frame\(s\) at 6.0 fps: sampling \(nframes=1, fps=None\) leaves "
                                         r"0 frame\(s\), fewer than the temporal patch of 2"):
        sample_frames(13, 6.0, nframes=1)


def test_folder_of_the_other_qwen_generation_names_its_tower(published):
    _, folder, _ = published["qwen2_vl"]
    with pytest.raises(PartError, match=r"model_type 'qwen2_vl', but the qwen2_5_vl tower reads model_type "
                                        r"'qwen2_5_vl'.*use vision tower 'qwen2_vl'"):
        build_part(vision_towers, {"name": "qwen2_5_vl", "pretrained": str(folder)}, "model.vision_tower")
    with pytest.raises(PartError, match=r"merger does not fit the patch_merger \(norm RMSNorm\): missing \[\], "
                                        r"unexpected \['ln_q.bias'\]"):
        build_part(connectors, {"name": "patch_merger", "norm": "rmsnorm", "pretrained": str(folder)}, "c",
                   vision_width=32, llm_width=48)
    with pytest.raises(PartError, match=r"^connector.pretrained: .*merger does not fit the patch_merger \(norm "
                                        r"LayerNorm\): the weights differ in shape: \['mlp.2.bias: \(48,\) vs ours "
                                        r"\(40,\)', 'mlp.2.weight: \(48, 128\) vs ours \(40, 128\)'\]"):
        build_part(connectors, {"name": "patch_merger", "norm": "layernorm", "pretrained": str(folder)}, "c",
                   vision_width=32, llm_width=40)  # the folder's LLM is 48 wide


def test_patches_and_grid_that_disagree():
    tower = build_part(vision_towers, {"name": "qwen2_vl", "preset": "tiny"}, "t")
    with pytest.raises(PartError, match=r"pixel_values has 20 patches but grid_thw \[\[1, 4, 4\]\] describes 16"):
        tower(torch.randn(20, 1176), torch.tensor([[1, 4, 4]]))


def test_llava_refuses_the_flat_parts_with_the_ones_it_takes():
    llava = models.get("llava")
    section = {"arch": "llava", "model_type": "tiny"}
    problems = model_settings(llava, {**section, "vision_tower": {"name": "qwen2_vl"}}).problems()
    assert ("model.vision_tower.name: qwen2_vl works on flat patch features of images of their own sizes, but this "
            "architecture takes fixed-size towers and connectors: valid here: clip, eva_vit_g, siglip") in problems
    problems = model_settings(llava, {**section, "connector": {"name": "patch_merger"}}).problems()
    assert any(p.startswith("model.connector.name: patch_merger works on flat patch features") for p in problems)


def test_vision_config_key_typo_suggests_the_key():
    with pytest.raises(PartError, match=r"vision_tower\.vision_config: unknown key\(s\) fullatt_block_index: did you "
                                        r"mean 'fullatt_block_indexes'\?; valid keys of Qwen2_5_VLVisionConfig: depth"):
        build_part(vision_towers, {"name": "qwen2_5_vl", "preset": "tiny",
                                   "vision_config": {"fullatt_block_index": [0]}}, "model.vision_tower")


def test_qwen_vl_image_before_a_fixed_size_tower_names_the_processor_to_use():
    from lavis_ds.image_config import image_problems

    datasets = {"coco": {"vis_processor": {"train": {"name": "qwen_vl_image"}}}}
    model = {"arch": "llava", "model_type": "tiny", "vision_tower": {"name": "clip", "preset": "tiny"}}
    assert image_problems(datasets, {}, model, models.get("llava"), []) == [
        "datasets.coco.vis_processor.train: qwen_vl_image prepares images for another kind of vision tower than the "
        "model's vision tower (clip); use tower_image_train"]
    # and the other way round, for the architecture that holds a Qwen-VL tower
    from lavis_ds.image_config import _kind_problems

    datasets = {"coco": {"vis_processor": {"eval": {"name": "tower_image_eval"}}}}
    assert _kind_problems(datasets, {"vision_tower": {"name": "qwen2_vl"}}, QwenVLProcessing()) == [
        "datasets.coco.vis_processor.eval: tower_image_eval prepares images for another kind of vision tower than the "
        "model's vision tower (qwen2_vl); use qwen_vl_image"]


def test_grad_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        tower = build_part(vision_towers, {"name": "qwen2_5_vl", "preset": "tiny", "freeze": False,
                                           "use_grad_checkpoint": checkpointed}, "t").train()
        calls = []
        tower.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
        grid = torch.tensor([[1, 10, 12], [2, 4, 4]])
        pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=torch.Generator().manual_seed(1))
        tower(pixels, grid).sum().backward()
        assert len(calls) == 1 + checkpointed  # recomputed in backward
        grads.append({n: p.grad for n, p in tower.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)
