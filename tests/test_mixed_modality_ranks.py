"""Ranks whose micro-batches hold different modalities stay in step: on 2 processes, rank 0 gets only text-only
samples and rank 1 only images and a video, under ZeRO-3 and under FSDP2; each run completes and takes the steps
(losses, final weights) of a 1-process replay of the same global batches.

Why this can go wrong: ZeRO-3 gathers a module's parameters when the module runs and FSDP2 unshards each block
before its forward, both as collectives, so a rank that skipped the vision tower would wait for a peer that is
gathering it (DeepSpeed #7170). lavis_ds runs the image path on a blank image in an image-free micro-batch
(``ImagePath.features``). ZeRO-3 keeps parameters under ``stage3_param_persistence_threshold`` elements
gathered for good; the runs here set it to 0, so every module's parameters are gathered when it runs, not only
the large ones. Without the blank image both engines' runs fail at once here (gloo: "Is there a distributed
collective mismatch"); on NCCL they would hang, which the timeout bounds.
"""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from archs import ARCHITECTURES, FLAT_ARCHITECTURES, build_tiny, image_side, tiny_model_section, without_dropout
from lavis_ds.apps.export_io import find_checkpoint, read_checkpoint
from lavis_ds.datasets.instruction import expand_video_marker
from lavis_ds.datasets.samplers import StepBatchSampler
from lavis_ds.processors.qwen_vl import GRID_KEY, SECONDS_KEY
from run_utils import assert_same_steps, kill, output_of, start, tiny_config, train_steps, write_yaml
from test_images_per_sample import write_video

SEED, MICRO, STEPS = 7, 2, 2
WAIT = 120  # s: a run takes ~5; a rank waiting on a collective its peer never joins waits forever
WORLD = 2
TEXT = {"instruction": "Say something kind.", "output": "You did well today."}
IMAGE = {"image": ["wide.png"], "instruction": "<Img><ImageHere></Img> What colour is it?",
         "output": "It is red."}
TWO_IMAGES = {"image": ["tall.png", "wide.png"], "instruction": "<Img><ImageHere><ImageHere></Img> Same colour?",
              "output": "No, one is green."}
VIDEO = {"video": "clip.mp4", "instruction": "<Img><ImageHere></Img> What happens?", "output": "It gets lighter."}
# Architectures run here: one Qwen-VL (flat patches, a grid per image, video as temporal patches: the blank image
# is one merge window with its own grid), the EVA + Q-Former path of fixed-size images, and Qwen3.5 (its padded rows'
# Gated-DeltaNet convolution, whose weight transformers' layer reads without calling the module).
ARCHS = ["qwen2_5_vl", "blip2_qwen", "qwen3_5"]
TOWERS = ("vision_tower.",)  # the trained towers' parameter names
EVAL_64 = {"train": {"name": "blip2_image_eval", "image_size": 64}, "eval": {"name": "blip2_image_eval",
                                                                            "image_size": 64}}


def _records() -> list[dict]:
    """The training records in dataset order, arranged so that the run's own sampler (StepBatchSampler seeded by
    run.seed, SEED here) deals text-only samples to rank 0 and to rank 1 an image sample and a video in every step
    (the first step's image sample one image, the second's two)."""
    count = MICRO * WORLD * STEPS
    records = [TEXT] * count
    for step, (stills, video) in enumerate(StepBatchSampler(count, MICRO, 1, WORLD, rank=1, seed=SEED)):
        records[stills], records[video] = (IMAGE, TWO_IMAGES)[step], VIDEO
    return records


def _data(root) -> tuple:
    """The annotation file and the media folder: two PNGs of other aspect ratios and a 4-frame MPEG-4 video."""
    media = root / "media"
    media.mkdir(parents=True)
    Image.new("RGB", (84, 56), (200, 30, 30)).save(media / "wide.png")
    Image.new("RGB", (56, 84), (30, 200, 30)).save(media / "tall.png")
    write_video(media / "clip.mp4", 4, size=(56, 56))
    annotations = root / "train.json"
    annotations.write_text(json.dumps(_records()))
    return annotations, media


def _config(out, arch, data, tokenizer, runner, nproc) -> dict:
    """``arch``'s tiny preset on the arranged records: one epoch of STEPS global batches of MICRO x WORLD samples,
    on WORLD processes (accumulation 1) or replayed on one (accumulation WORLD: the same micro-batches in order)."""
    annotations, media = data
    zero3 = {"deepspeed_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    deepspeed = runner == "runner_deepspeed"
    cfg = tiny_config(out, media, stage=3 if deepspeed else None, micro=MICRO, accum=WORLD // nproc, runner=runner,
                      sizes=(0, 0, 0), seed=SEED, valid_splits=[], test_splits=[], **(zero3 if deepspeed else {}))
    section = {"builder": "minigpt4qwen_instruction", "build_info": {
        "annotations": {"train": {"storage": str(annotations)}}, "images": {"storage": str(media)},
        "max_frames": 4}}
    if arch == "blip2_qwen":  # fixed-size images: its EVA tower's 64 px (Qwen-VL gets its own processor)
        section["vis_processor"] = EVAL_64
    cfg["datasets"] = {"mixed": section}
    cfg["model"] = tiny_model_section(arch, tokenizer, out.parent, **without_dropout(arch))
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_tokenizer_dir):
    """Per architecture: output folders of ZeRO-3 and FSDP2 on 2 processes and the 1-process replay (ZeRO-3)."""
    done = {}

    def run(arch):
        if arch not in done:
            root = tmp_path_factory.mktemp(arch)
            data = _data(root / "data")
            jobs = {}
            for name, runner, nproc in (("zero3", "runner_deepspeed", 2), ("fsdp", "runner_fsdp", 2),
                                        ("replay", "runner_deepspeed", 1)):
                cfg = _config(root / name, arch, data, tiny_tokenizer_dir, runner, nproc)
                jobs[name] = start(write_yaml(root / f"{name}.yaml", cfg), nproc=nproc if nproc > 1 else 0)
            try:
                for name, job in jobs.items():
                    # A hang is a timeout here, not a stuck suite: each run takes seconds.
                    assert job.wait(timeout=WAIT) == 0, f"{arch} {name}:\n{output_of(job)[-4000:]}"
            finally:
                for job in jobs.values():
                    if job.poll() is None:
                        kill(job)
            done[arch] = {name: root / name for name in jobs}
        return done[arch]
    return run


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
@pytest.mark.parametrize("arch", ARCHS)
def test_text_only_and_visual_ranks_take_the_one_process_steps(arch, engine, runs):
    outs = runs(arch)
    assert [m["step"] for m in train_steps(outs["replay"])] == list(range(1, STEPS + 1))
    # fp32 sums over 2 processes add in another order than over 1: equal up to rounding.
    assert_same_steps(outs[engine], outs["replay"], range(1, STEPS + 1), 1e-5)
    for mine, theirs in zip(train_steps(outs[engine]), train_steps(outs["replay"]), strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (mine, theirs)
    mine, _ = read_checkpoint(find_checkpoint(outs[engine]))
    replayed, _ = read_checkpoint(find_checkpoint(outs["replay"]))
    assert mine.keys() == replayed.keys() and any(name.startswith(TOWERS) for name in mine)
    for name, tensor in replayed.items():
        # atol as in test_fsdp: attention key biases have zero gradients in exact arithmetic, which Adam turns
        # into lr-sized steps of rounding noise; everything else agrees to ~1e-6.
        torch.testing.assert_close(mine[name], tensor, rtol=1e-4, atol=2e-4, msg=name)


# ---- in-process: every architecture runs the same modules whatever the micro-batch holds -----------------------

def _batch(model, kind: str, flat: bool) -> dict:
    """Two samples of one ``kind``: text only, one image each, or a 4-frame video each (a Qwen-VL tower's temporal
    patches where the architecture takes them; otherwise the frames as images, one marker each, as the datasets
    give a fixed-size tower's video)."""
    side = image_side(model)
    text = {"output": [["Yes."], ["A red square on grey."]]}
    if kind == "text":
        return {**text, "image": torch.zeros(0, 3, side, side), "num_images": [0, 0],
                "instruction": [["Say something."], ["What is it?"]]}
    if kind == "image":
        return {**text, "image": torch.randn(2, 3, side, side), "num_images": [1, 1],
                "instruction": [["<Img><ImageHere></Img> What?"]] * 2}
    if flat:
        frames = [Image.new("RGB", (side, side), (40 * k, 40, 40)) for k in range(4)]
        made = [model.vision_tower.processing.video(frames) for _ in range(2)]
        video = {**text, "image": torch.cat([v.pixel_values for v in made]), "num_images": [1, 1],
                 GRID_KEY: torch.stack([v.grid_thw for v in made]), SECONDS_KEY: [v.second_per_grid_t for v in made],
                 "instruction": [["<Img><ImageHere></Img> What happens?"]] * 2}
        return video
    return {**text, "image": torch.randn(8, 3, side, side), "num_images": [4, 4],
            "instruction": [expand_video_marker(["<Img><ImageHere></Img> What happens?"], 4)] * 2}


def _gathers(model, batch: dict) -> list[str]:
    """The modules holding parameters, in the order their forwards start, over one forward and backward of
    ``batch``: where ZeRO-3 gathers (and FSDP2 unshards) what each rank must gather alike."""
    called: list[str] = []
    hooks = [module.register_forward_pre_hook(lambda _m, _a, name=name: called.append(name))
             for name, module in model.named_modules() if any(True for _ in module.parameters(recurse=False))]
    try:
        model(batch)["loss"].backward()
    finally:
        for hook in hooks:
            hook.remove()
    return called


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_text_image_and_video_micro_batches_run_the_same_modules_in_the_same_order(arch, tiny_tokenizer_dir,
                                                                                    tmp_path):
    torch.manual_seed(0)
    model = build_tiny(arch, tiny_tokenizer_dir, tmp_path, **without_dropout(arch))
    flat = arch in FLAT_ARCHITECTURES
    orders = {kind: _gathers(model, _batch(model, kind, flat)) for kind in ("text", "image", "video")}
    assert any("vision_tower." in name for name in orders["text"])  # the blank image
    assert orders["text"] == orders["image"] == orders["video"]
