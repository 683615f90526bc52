"""--format hf for the composed architectures: llava -> LlavaForConditionalGeneration, instructblip ->
InstructBlipForConditionalGeneration, and the pairs no transformers class holds, refused.

The main check builds tiny random models, writes their folders, and runs docs/export-hf.md's lines in a fresh
interpreter where importing lavis_ds fails: the token ids must be the ones lavis_ds.apps.generation generates
from the same model, for a batch of prompts of different lengths, a second turn after an answer, and two images
in one prompt. (tests/test_export_hf.py does the same for BLIP-2 on the trained demo, through ``export.py``.)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lavis_ds.apps.export_hf import write_hf_folder
from lavis_ds.apps.export_hf_checks import check_expressible
from lavis_ds.apps.export_io import ExportError
from lavis_ds.models import InstructBlip, Llava

DOCS = Path(__file__).resolve().parent.parent / "docs" / "export-hf.md"
QUESTIONS = ["What is in the image?", "What color is the ball?", "How many animals are there? Describe them."]

# docs/export-hf.md's lines per class, run as a transformers user runs them; the doc must hold each one.
# `folder`, `images` (PIL), `messages_list` and (InstructBLIP) `instructions` are set by the script around them.
DOC_LINES = {
    "llava": [
        'processor = AutoProcessor.from_pretrained(folder, backend="pil")',
        "model = LlavaForConditionalGeneration.from_pretrained(folder)",
        "prompts = [processor.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) "
        "for m in messages_list]",
        'inputs = processor(images=images, text=prompts, padding=True, return_tensors="pt")',
        "output = model.generate(**inputs, generation_config=model.generation_config)",
        "new_tokens = output[:, inputs.input_ids.shape[1]:]",
    ],
    "instructblip": [
        'processor = AutoProcessor.from_pretrained(folder, backend="pil")',
        "model = InstructBlipForConditionalGeneration.from_pretrained(folder)",
        "prompts = [processor.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) "
        "for m in messages_list]",
        'inputs = processor.tokenizer(prompts, padding=True, return_tensors="pt")',
        'pixel_values = processor.image_processor(images, return_tensors="pt").pixel_values',
        'qformer = processor.qformer_tokenizer(instructions, padding=True, truncation=True, return_tensors="pt")',
        "output = model.generate(**inputs, pixel_values=pixel_values, qformer_input_ids=qformer.input_ids, "
        "qformer_attention_mask=qformer.attention_mask, generation_config=model.generation_config)",
        "new_tokens = output[:, inputs.input_ids.shape[1]:]",
    ],
}
# Run with importing lavis_ds made to fail: transformers, torch and PIL only. One interpreter for every export.
TRANSFORMERS_ONLY = """
import json, sys
sys.modules["lavis_ds"] = None
from PIL import Image
from transformers import AutoProcessor, InstructBlipForConditionalGeneration, LlavaForConditionalGeneration
results = []
for job in json.loads(sys.argv[1]):
    folder, answers = job["folder"], []
    for request in job["requests"]:
        images = [Image.open(path) for path in request["images"]]
        messages_list, instructions = request["messages"], request["instructions"]
        if job["arch"] == "llava":
{llava}
        else:
{instructblip}
        answers.append(new_tokens.tolist())
    results.append(answers)
print(json.dumps(results))
"""


def _user(*items: str | None) -> dict:
    """A user turn: None is an image item, a string a text item."""
    return {"role": "user", "content": [{"type": "image"} if item is None else {"type": "text", "text": item}
                                        for item in items]}


def _requests(paths: list[str]) -> list[dict]:
    """Each request as transformers gets it and as lavis_ds gets it (questions, answers, images per sample)."""
    batch = {"images": paths[:3], "messages": [[_user(None, q)] for q in QUESTIONS], "instructions": QUESTIONS,
             "lavis_ds": {"prompts": QUESTIONS, "answers": None, "num_images": [1, 1, 1]}}
    turns = [QUESTIONS[1], QUESTIONS[2]]
    multi_turn = {"images": paths[:2],
                  "messages": [[_user(None, turns[0]), {"role": "assistant", "content": answer}, _user(turns[1])]
                               for answer in ("red", "a cat and a dog")],
                  # The Q-Former reads the turn that holds the image: the first question, as in lavis_ds.
                  "instructions": [turns[0], turns[0]],
                  "lavis_ds": {"prompts": [turns, turns], "answers": [["red"], ["a cat and a dog"]],
                               "num_images": [1, 1]}}
    two_images = {"images": paths[1:3], "messages": [[_user(None, "Compare ", None, "these two.")]],
                  "instructions": ["Compare these two.", "Compare these two."],
                  "lavis_ds": {"prompts": ["<Img><ImageHere></Img> Compare <Img><ImageHere></Img> these two."],
                               "answers": None, "num_images": [2]}}
    return [batch, multi_turn, two_images]


def _lavis_ds_token_ids(model, request: dict) -> list[list[int]]:
    """What lavis_ds.apps.generation generates, as the token ids its LLM's generate returned."""
    from lavis_ds.apps.generation import generate
    from lavis_ds.processors.image import Blip2ImageEvalProcessor

    vis = Blip2ImageEvalProcessor(image_size=model.image_size)  # what generate uses for a run without datasets
    images = torch.stack([vis(Image.open(path).convert("RGB")) for path in request["images"]])
    spec = request["lavis_ds"]
    returned = []
    llm_generate = model.llm_model.generate
    model.llm_model.generate = lambda *a, **k: returned.append(llm_generate(*a, **k)) or returned[-1]
    try:
        generate(model, images, spec["prompts"], spec["answers"], spec["num_images"])
    finally:
        del model.llm_model.generate
    return returned[0].tolist()


@pytest.fixture(scope="module")
def image_paths(tmp_path_factory) -> list[str]:
    """Images of different sizes and aspect ratios, in colours that move the features."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, (height, width) in enumerate([(64, 64), (48, 90), (100, 70)]):
        path = folder / f"image_{i}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def llava_model(tokenizer_dir, **tower) -> Llava:
    cfg = Llava.default_config("tiny")
    cfg["tokenizer"] = str(tokenizer_dir)
    cfg["vision_tower"] = {**cfg["vision_tower"], **tower}
    torch.manual_seed(0)
    return Llava.from_config(cfg).eval()


def instructblip_model(tokenizer_dir, bert_dir) -> InstructBlip:
    cfg = InstructBlip.default_config("tiny")
    cfg["tokenizer"] = str(tokenizer_dir)
    # transformers' post_layernorm has the vision config's eps; with the same, the export is bit for bit.
    cfg["connector"] = {**cfg["connector"], "qformer_tokenizer": str(bert_dir), "ln_vision_eps": 1e-6}
    torch.manual_seed(0)
    return InstructBlip.from_config(cfg).eval()


def _siglip(tokenizer_dir):
    return llava_model(tokenizer_dir, name="siglip", preset="tiny", vision_config={"image_size": 56, "patch_size": 14},
                       vision_feature_layer=-1, vision_feature_select_strategy="full")


BUILDS = {"llava-clip": ("llava", lambda tok, bert: llava_model(tok)),
          "llava-siglip": ("llava", lambda tok, bert: _siglip(tok)),
          "instructblip": ("instructblip", lambda tok, bert: instructblip_model(tok, bert))}


@pytest.fixture(scope="module")
def exports(tiny_tokenizer_dir, tiny_bert_tokenizer_dir, image_paths, tmp_path_factory) -> dict[str, tuple]:
    """Per model: (what lavis_ds generated, what transformers alone generated from its export, the export's notes)."""
    root = tmp_path_factory.mktemp("hf_arch")
    requests = _requests(image_paths)
    sent = [{k: v for k, v in r.items() if k != "lavis_ds"} for r in requests]
    expected, jobs, notes = {}, [], {}
    for name, (arch, build) in BUILDS.items():
        model = build(tiny_tokenizer_dir, tiny_bert_tokenizer_dir)
        with torch.no_grad():  # random weights answer alike whatever the image: make the image path count
            for param in model.connector.parameters():
                param.mul_(4)
        notes[name] = write_hf_folder(model, root / name)
        expected[name] = [_lavis_ds_token_ids(model, request) for request in requests]
        jobs.append({"folder": str(root / name), "arch": arch, "requests": sent})
    script = TRANSFORMERS_ONLY.format(**{arch: "\n".join(" " * 12 + line for line in lines)
                                         for arch, lines in DOC_LINES.items()})
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(jobs)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: (expected[name], answers, notes[name]) for name, answers in zip(BUILDS, got, strict=True)}


@pytest.mark.parametrize("name", BUILDS)
def test_transformers_alone_generates_the_tokens_lavis_ds_generates(exports, name):
    expected, got, notes = exports[name]
    assert notes == []  # nothing computes differently
    assert got == expected  # batch (left padding), second turn, two images in one prompt; finished rows padded alike
    # The comparison says something: the answers differ between images.
    assert len({tuple(row) for row in expected[0]}) > 1, expected[0]


def test_the_docs_hold_the_lines_the_test_runs():
    text = DOCS.read_text()
    missing = [line for lines in DOC_LINES.values() for line in lines if line not in text]
    assert not missing, f"docs/export-hf.md lacks: {missing}"
