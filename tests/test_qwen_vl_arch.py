"""The qwen2_vl and qwen2_5_vl architectures on their data: the qwen_vl_image processor's output (images of their own
sizes, several per sample, a video) through the dataset and the collater into the model, the vision span in the
prompt, packed equal to padded (loss and gradients, fp32) with images of different grids, and the tiny preset
training through train.py on the demo's images of random sizes, its FLOPs logged; lmms-eval's own models on the
`--format hf` export (docs/models.md's lmms-eval column)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from archs import build_tiny, loss_and_grads
from lavis_ds.common.errors import LavisDsError
from lavis_ds.common.registry import processors
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from lavis_ds.datasets.instruction import InstructionDataset
from lavis_ds.models.image_tokens import GRID_KEY, SECONDS_KEY
from lavis_ds.models.prompt import insert_image_placeholders
from lavis_ds.processors.qwen_vl import tokens_for_grid
from run_utils import REPO, run_train, train_steps, write_yaml
from test_images_per_sample import write_json, write_video

KINDS = ["qwen2_vl", "qwen2_5_vl"]
# Sizes (width, height) px: two of another aspect each, and one large enough for Qwen2.5-VL's 112 px windows.
RECORDS = [{"instruction": "Say hello.", "output": "Hello."},
           {"image": ["wide.png", "tall.png"], "instruction": "<Img><ImageHere><ImageHere></Img> Same shape?",
            "output": "No, one is wider."},
           {"video": "clip.mp4", "instruction": "<Img><ImageHere></Img> What happens?", "output": "It brightens."},
           {"image": "large.png", "instruction": "<Img><ImageHere></Img> What is it?", "output": "A square."}]
SIZES = {"wide.png": (150, 70), "tall.png": (60, 130), "large.png": (180, 170)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_data")
    rng = np.random.default_rng(0)
    for name, (w, h) in SIZES.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name)
    write_video(root / "clip.mp4", frames=4, size=(112, 84))
    return write_json(root / "records.json", RECORDS), root


def batch_of(model, data) -> dict:
    """The four records through the dataset (the model's own processor, filled from its tower) and the collater."""
    path, root = data
    processor = processors.get("qwen_vl_image")(**model.vision_tower.processing.processor_keys())
    dataset = InstructionDataset(path, root, processor, max_frames=4)
    return dataset.collater([dataset[i] for i in range(len(dataset))])


@pytest.fixture(scope="module")
def models(tiny_tokenizer_dir, tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            torch.manual_seed(0)
            made[kind] = build_tiny(kind, tiny_tokenizer_dir, tmp_path_factory.mktemp(kind)).eval()
        return made[kind]
    return get


@pytest.mark.parametrize("kind", KINDS)
def test_processed_images_travel_through_the_collater_into_the_model(kind, models, data):
    model = models(kind)
    batch = batch_of(model, data)
    grids = batch[GRID_KEY].tolist()
    assert batch["num_images"] == [0, 2, 1, 1] and len(grids) == 4  # the video is one visual of its frames
    assert grids[2][0] == 2 and len({tuple(g[1:]) for g in grids}) == 4  # two temporal patches; four grids
    assert batch["image"].shape[0] == sum(t * h * w for t, h, w in grids)  # flat patches, end to end
    assert batch[SECONDS_KEY][2] is not None and batch[SECONDS_KEY][:2] + batch[SECONDS_KEY][3:] == [None] * 3
    prepared = model.prepare_batch(batch)
    counts = [tokens_for_grid(g) for g in grids]
    assert prepared["image_tokens"] == counts
    image_id, video_id = model.llm.prompt.placeholder_ids  # a video's placeholders are <|video_pad|>
    assert (prepared["input_ids"] == image_id).sum(1).tolist() == [0, counts[0] + counts[1], 0, counts[3]]
    assert (prepared["input_ids"] == video_id).sum(1).tolist() == [0, 0, counts[2], 0]
    # the file's own rate (8 fps, all 4 frames taken), not an assumed 24: two frames per temporal patch, 0.25 s
    assert batch[SECONDS_KEY][2] == pytest.approx(0.25)
    start, end = (model.llm.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    ids = prepared["input_ids"][1].tolist()  # two images: <vs> pads <ve> <vs> pads <ve> Same shape?
    first = ids.index(start)
    assert ids[first + 1:first + 1 + counts[0]] == [image_id] * counts[0] and ids[first + 1 + counts[0]] == end
    assert prepared["rope_position_ids"].shape == (3, *prepared["input_ids"].shape)
    out = model(batch)
    assert math.isfinite(float(out["loss"].detach())) and int(out["num_tokens"]) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_packed_equals_padded_with_images_of_different_grids(kind, models, data):
    model = models(kind)
    batch = batch_of(model, data)
    padded, loss_a, grads_a = loss_and_grads(model, batch, None)
    longest = int(padded["attention_mask"].sum(1).max())
    # The shortest rows that lay the samples out in another order: each sample's images must follow it.
    row = next(n for n in range(longest, 3 * longest)
               if model.prepare_batch(dict(batch), pack_to=n)["order"] != [0, 1, 2, 3])
    packed, loss_b, grads_b = loss_and_grads(model, batch, row)
    assert packed["input_ids"].shape[0] < 4  # samples share rows
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and any(n.startswith("vision_tower.") for n in grads_a)
    whole = torch.cat([g.flatten() for g in grads_a.values()]).norm()
    for name, grad in grads_a.items():
        assert (grads_b[name] - grad).norm() <= 1e-6 * grad.norm() + 1e-7 * whole, name


def test_the_vision_span_replaces_minigpt4qwens_img_tags():
    span = ("<|vision_start|>", "<|vision_end|>")
    assert insert_image_placeholders(["<Img><ImageHere><ImageHere></Img> Same?"], "P", [1, 2], image_span=span) == \
        ["<|vision_start|>P<|vision_end|><|vision_start|>PP<|vision_end|>Same?"]
    assert insert_image_placeholders(["What is it?"], "P", [2], image_span=span) == \
        ["<|vision_start|>PP<|vision_end|>What is it?"]  # an unmarked image in front, as Qwen's template puts it
    assert insert_image_placeholders(["What is it?"], "P", [2]) == ["<Img>PP</Img> What is it?"]
    assert insert_image_placeholders(["<ImageHere><ImageHere>Same?"], ["P", "V"], [1, 2], image_span=span) == \
        ["<|vision_start|>P<|vision_end|><|vision_start|>VV<|vision_end|>Same?"]  # each visual's own token


def test_a_pixel_tensor_of_a_size_the_tower_cannot_take_is_named(models):
    model = models("qwen2_vl")
    with pytest.raises(LavisDsError, match=r"an image tensor of 56x60 px \(height x width\) for Qwen2VL: valid sides "
                                           r"are multiples of 28 px; give PIL images through the qwen_vl_image"):
        model.prepare_batch({"image": torch.zeros(1, 3, 56, 60), "instruction": [["What?"]], "output": [["A."]]})


def test_the_tiny_preset_trains_through_train_py_on_images_of_random_sizes(tmp_path):
    """projects/demo/tiny_qwen2_5_vl_zero2.yaml on one process (ZeRO-2, fp32), on demo images of random sizes."""
    import yaml

    storage = ensure_demo_shapes(tmp_path / "shapes", DemoShapesSpec(num_train=32, num_val=4, num_test=4,
                                                                     size_jitter=0.5))
    sizes = {Image.open(p).size for p in (storage / "images").glob("train_*.png")}
    assert len(sizes) > 16  # random sizes, not one
    cfg = yaml.safe_load((REPO / "projects/demo/tiny_qwen2_5_vl_zero2.yaml").read_text())
    cfg["datasets"]["demo_shapes"]["build_info"].update(storage=str(storage), num_train=32, num_val=4, num_test=4)
    cfg["run"].update(output_dir=str(tmp_path / "out"), max_epoch=2, batch_size_train=8, warmup_steps=2,
                      valid_splits=[], test_splits=[], log_freq=1)
    run_train(write_yaml(tmp_path / "run.yaml", cfg), nproc=0)
    steps = train_steps(tmp_path / "out")
    losses = [m["loss"] for m in steps]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert all(m["tflops_per_device"] > 0 for m in steps)  # the FLOP model counts each image by its grid
    assert sum(losses[-2:]) < sum(losses[:2])  # it learns


@pytest.mark.parametrize("kind", KINDS)
def test_the_hf_export_reloads_under_transformers_alone_and_generates_the_same_tokens(kind, models, tmp_path):
    """--format hf writes the family's class and processor; transformers' Auto classes read them back, the processor
    prompts two images of other sizes, and a video, as lavis_ds does, and greedy generation gives lavis_ds's answer."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lavis_ds.apps.export_hf import write_hf_folder

    model = models(kind)
    assert write_hf_folder(model, tmp_path) == []  # fp32, nothing computed otherwise
    theirs = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    processor = AutoProcessor.from_pretrained(tmp_path)
    assert type(theirs).__name__ == {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                     "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[kind]
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((90, 200), (150, 60))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    ours = processors.get("qwen_vl_image")(**model.vision_tower.processing.processor_keys())
    sample = {"instruction": [["<ImageHere><ImageHere>What is it?"]], "num_images": [2], **ours.sample_fields(pictures)}
    torch.testing.assert_close(inputs["pixel_values"], sample["image"], atol=0, rtol=0)
    counts = model.image_path.layout.counts(sample)
    assert model.llm.prompt.generation_prompt(sample["instruction"][0], (), 2, counts) == inputs["input_ids"][0].tolist()
    steps = dict(max_new_tokens=6, min_new_tokens=6)
    new = theirs.generate(**inputs, **steps)[0, inputs["input_ids"].shape[1]:]
    assert model.generate(sample, **steps) == [processor.tokenizer.decode(new, skip_special_tokens=True).strip()]

    # A video item: the template writes <|vision_start|><|video_pad|><|vision_end|>, the processor expands it into the
    # video's tokens and times it by the file's rate (4 frames of a 2 fps file), as lavis_ds's prompt does.
    from transformers.video_utils import VideoMetadata

    frames = [Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)) for _ in range(4)]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="pt",
                       video_metadata=[VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])],
                       do_sample_frames=False)
    sample = {"instruction": [["<ImageHere>What happens?"]], "num_images": [1],
              **ours.sample_fields(frames, video=True, fps=2.0)}
    assert model.llm.prompt.generation_prompt(sample["instruction"][0], (), 1, model.image_path.layout.counts(sample),
                                          videos=[True]) == inputs["input_ids"][0].tolist()
    new = theirs.generate(**inputs, **steps)[0, inputs["input_ids"].shape[1]:]
    assert model.generate(sample, **steps) == [processor.tokenizer.decode(new, skip_special_tokens=True).strip()]


@pytest.mark.parametrize("kind", KINDS)
def test_show_sample_shows_the_ids_the_model_prepares(kind, models, data):
    """show-sample counts each image's placeholders by its processor (no model built), as the model does by its
    tower: the same ids for text only, two images of their own sizes, a video and one large image."""
    from lavis_ds.show_sample import render, training_sequences

    model = models(kind)
    path, root = data
    processor = processors.get("qwen_vl_image")(**model.vision_tower.processing.processor_keys())
    dataset = InstructionDataset(path, root, processor, max_frames=4)
    for index in range(len(dataset)):
        prepared = model.prepare_batch(dataset.collater([dataset[index]]))
        shown, = training_sequences(model.llm.prompt, dataset, index, f"record {index}")
        assert shown.ids == prepared["input_ids"][0][prepared["attention_mask"][0].bool()].tolist(), index
        image_id, video_id = model.llm.prompt.placeholder_ids  # the video record's are <|video_pad|>, as training's
        tokens = sum(prepared["image_tokens"])
        video = bool(RECORDS[index].get("video"))
        assert (shown.ids.count(image_id), shown.ids.count(video_id)) == ((0, tokens) if video else (tokens, 0))
        if video:
            shown_text = render(model.llm.prompt, shown.ids, shown.labels, color=False)
            assert f"<|vision_start|><video x{tokens}><|vision_end|>" in shown_text


@pytest.mark.parametrize("exported, first_size", [
    (dict(max_pixels=28 * 28 * 24), "448x112"),  # a smaller budget: the first image over it gets fewer tokens
    (dict(min_pixels=112 * 112), "10x10"),  # a larger least area: small images get more
    (dict(merge_size=1), "10x10"),  # four times the tokens of every image
])
def test_the_export_refuses_a_processor_reserving_other_counts_naming_the_first_size(models, exported, first_size,
                                                                                    tmp_path):
    """The export-time sweep (run by every --format hf export of the family, as in the test above) on a processor
    whose image processor is not training's: refused with the first size of the sweep whose counts differ."""
    from dataclasses import replace

    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from lavis_ds.models.export_folder import ExportError
    from lavis_ds.models.hf.qwen_vl import processor_settings
    from lavis_ds.models.hf.qwen_vl_sweep import check_placeholder_sweep

    model = models("qwen2_vl")
    trained = model.vision_tower.processing

    def processor(processing):
        settings = processor_settings(processing)
        return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**settings), tokenizer=model.llm.tokenizer,
                                video_processor=Qwen2VLVideoProcessor(**settings))

    check_placeholder_sweep(processor(trained), trained, "the export")  # training's settings: every size agrees
    with pytest.raises(ExportError, match=rf"--format hf: the exported Qwen2VLProcessor in the export reserves \d+ "
                                          rf"<\|image_pad\|> tokens for an image of {first_size} px \(width x height\),"
                                          rf" training reserved \d+ \(qwen_vl_image's tokens_for_image with min_pixels "
                                          rf"3136, max_pixels 37632, patch_size 14, merge_size 2\)"):
        check_placeholder_sweep(processor(replace(trained, **exported)), trained, "the export")


@pytest.mark.parametrize("kind", KINDS)
def test_the_prepared_grid_stays_on_the_host_and_the_forward_waits_for_no_device(kind, models, data):
    """prepare_batch gives the grid as host rows, which the engines' to_compute (every tensor to the device) leaves
    where it is; the tower reads them, and the forward and backward make no host-syncing op in lavis_ds's lines
    (HostSyncs; on the CPU it sees int(), bool(), .item() of a tensor, but not .tolist(): what reaches the tower is
    checked to be the rows, not a tensor the engines would have moved to the GPU)."""
    from lavis_ds.common.precision import to_compute
    from test_vision_llm import HostSyncs

    model = models(kind)
    moved = to_compute(model.prepare_batch(batch_of(model, data)), "cpu", torch.float32)
    assert isinstance(moved[GRID_KEY], list) and all(isinstance(v, int) for row in moved[GRID_KEY] for v in row)
    grids = []
    hook = model.vision_tower.register_forward_pre_hook(lambda tower, args: grids.append(args[1]))
    try:
        with HostSyncs() as syncs:
            model(moved)["loss"].backward()
    finally:
        hook.remove()
    assert syncs.lines == []
    assert isinstance(grids[0], list) and grids[0] == moved[GRID_KEY]  # the rows themselves reach the tower


@pytest.mark.parametrize("kind", KINDS)
def test_preference_pairs_of_processed_images_and_a_video_score_as_their_sides_do(kind, models, data):
    """A pair micro-batch of qwen_vl_image output (grid rows, a video's seconds): prepare_pairs gives each side the
    pairs' images, the vision pass runs once, and each side's answer log-prob equals the side scored alone."""
    from lavis_ds.models.vision_llm_batch import keep_samples
    from lavis_ds.objectives.model_calls import answer_logps, image_features, prepare_pairs

    model = models(kind)
    batch = batch_of(model, data)
    keep = [1, 2]  # two images of their own sizes, and the video
    pairs = {**keep_samples(batch, keep), "chosen": ["No, one is wider.", "It brightens."],
             "rejected": ["Yes.", "It darkens slowly."]}
    pairs["instruction"] = [turns[:1] for turns in pairs["instruction"]]
    del pairs["output"]
    prepared = prepare_pairs(model, pairs)
    assert prepared[GRID_KEY] == model.prepare_batch(keep_samples(batch, keep))[GRID_KEY]  # once, as host rows
    with torch.no_grad():
        logps, _ = answer_logps(model, prepared, image_features(model, prepared))
        for side, answers in enumerate((pairs["chosen"], pairs["rejected"])):
            alone, _ = model.answer_logps({**pairs, "output": [[a] for a in answers]})
            torch.testing.assert_close(logps[2 * side:2 * side + 2], alone, atol=1e-5, rtol=1e-5)



@pytest.fixture(scope="module")
def lmms_eval_exports(models, tmp_path_factory):
    """``kind -> (its --format hf export, the answers `--model lavis_ds` gives on the model the export holds)`` over
    the demo's caption task (tests/lmms_eval_runs.py), and the demo data it reads, offline."""
    from lavis_ds.apps.export_hf import write_hf_folder
    from lavis_ds.runners.lmms_eval.model import LavisDsLmms
    from lmms_eval_runs import caption_answers, offline

    root = tmp_path_factory.mktemp("lmms_eval")
    storage = ensure_demo_shapes(root / "demo", DemoShapesSpec(num_train=4, num_val=4, num_test=4))
    made = {}

    def get(kind):
        if kind not in made:
            model = models(kind)
            assert write_hf_folder(model, root / kind) == []
            image_processor = processors.get("qwen_vl_image")(**model.vision_tower.processing.processor_keys())
            made[kind] = root / kind, caption_answers(LavisDsLmms(model, image_processor))
        return made[kind]

    with offline(storage, root / "datasets_cache"):
        yield get


@pytest.mark.parametrize("lmms_model", ["own", "huggingface"])
@pytest.mark.parametrize("kind", KINDS)
def test_lmms_eval_s_own_model_on_the_export_does_what_docs_models_md_says(kind, lmms_model, models,
                                                                           lmms_eval_exports):
    """docs/models.md's lmms-eval column: lmms-eval's `qwen2_vl` / `qwen2_5_vl` on the CPU, given the export's pixel
    bounds (its defaults are its own: Qwen2.5-VL's min_pixels upscales a 64 px image), gives lavis_ds's answers;
    `huggingface` fails in lmms-eval 0.7.3 (it passes `audios=`, which transformers 5.24 refuses)."""
    from lmms_eval_runs import CPU_ARGS, caption_answers

    folder, ours = lmms_eval_exports(kind)
    assert len(set(ours)) > 1, ours  # the answers depend on the image
    if lmms_model == "huggingface":
        with pytest.raises(ValueError, match=r"keyword argument `audios` which is deprecated"):
            caption_answers("huggingface", f"pretrained={folder},{CPU_ARGS['huggingface']}")
        return
    processing = models(kind).vision_tower.processing.processor_keys()  # the bounds the export's processor holds
    pixels = f"min_pixels={processing['min_pixels']},max_pixels={processing['max_pixels']}"
    assert caption_answers(kind, f"pretrained={folder},{CPU_ARGS[kind]},{pixels}") == ours
