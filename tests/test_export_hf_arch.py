"""--format hf for the composed architectures: llava -> LlavaForConditionalGeneration, instructblip ->
InstructBlipForConditionalGeneration, and the pairs no transformers class holds, refused.

The main check builds tiny random models, writes their folders, and runs docs/export-hf.md's lines in a fresh
interpreter where importing lavis_ds fails: the token ids must be the ones lavis_ds.apps.generation generates
from the same model, for a batch of prompts of different lengths, a second turn after an answer, and two images
in one prompt. (tests/test_export_hf.py does the same for BLIP-2 on the trained demo, through ``export.py``.)
lmms-eval's own models run on each export as docs/models.md's lmms-eval column says (tests/lmms_eval_runs.py).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from lavis_ds.apps.export_hf import write_hf_folder
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


def _lavis_ds_token_ids(model, request: dict, vis=None, **generate_kwargs) -> list[list[int]]:
    """What lavis_ds.apps.generation generates, as the token ids its LLM's generate returned; ``vis``: the image
    processor (default: what generate uses for a run without datasets, the tower's processing)."""
    from lavis_ds.apps.export_hf_processor import default_image_cfg
    from lavis_ds.apps.generation import generate
    from lavis_ds.datasets.processor_sections import build_processor

    vis = vis or build_processor(default_image_cfg(model))
    images = torch.stack([vis(Image.open(path).convert("RGB")) for path in request["images"]])
    spec = request["lavis_ds"]
    returned = []
    llm_generate = model.llm_model.generate
    model.llm_model.generate = lambda *a, **k: returned.append(llm_generate(*a, **k)) or returned[-1]
    try:
        generate(model, images, spec["prompts"], spec["answers"], spec["num_images"], **generate_kwargs)
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


def llava_model(tokenizer_dir, lora: bool = False, **tower) -> Llava:
    cfg = Llava.default_config("tiny")
    cfg["tokenizer"] = str(tokenizer_dir)
    if lora:
        cfg.update(get_lora=True, freeze_llm=True, lora_r=4)
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
    """A SigLIP tower (no CLS, every patch) and LoRA on the LLM, which the export merges."""
    return llava_model(tokenizer_dir, lora=True, name="siglip", preset="tiny",
                       vision_config={"image_size": 56, "patch_size": 14}, vision_feature_layer=-1,
                       vision_feature_select_strategy="full")


# LLaVA-1.5's CLIP tower pads to a square (a CLIP crop of some sizes is a pixel off: docs/export-hf.md).
BUILDS = {"llava-clip": ("llava", lambda tok, bert: llava_model(tok, pad_to_square=True)),
          "llava-siglip": ("llava", lambda tok, bert: _siglip(tok)),
          "instructblip": ("instructblip", lambda tok, bert: instructblip_model(tok, bert))}


@pytest.fixture(scope="module")
def exports(tiny_tokenizer_dir, tiny_bert_tokenizer_dir, image_paths, tmp_path_factory) -> dict[str, tuple]:
    """Per model: (what lavis_ds generated, what transformers alone generated from its export, the export's notes,
    the export folder, the model as exported)."""
    root = tmp_path_factory.mktemp("hf_arch")
    requests = _requests(image_paths)
    sent = [{k: v for k, v in r.items() if k != "lavis_ds"} for r in requests]
    expected, jobs, notes, models = {}, [], {}, {}
    for name, (arch, build) in BUILDS.items():
        model = build(tiny_tokenizer_dir, tiny_bert_tokenizer_dir)
        with torch.no_grad():  # random weights answer alike whatever the image: make the image path count
            for param in model.connector.parameters():
                param.mul_(4)
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:  # LoRA's B starts at zero: give the merge something to merge
                    param.normal_(std=0.5)
        expected[name] = [_lavis_ds_token_ids(model, request) for request in requests]
        model.merge_lora()  # as export.py does: the classes have no adapters
        notes[name] = write_hf_folder(model, root / name)
        models[name] = model
        jobs.append({"folder": str(root / name), "arch": arch, "requests": sent})
    script = TRANSFORMERS_ONLY.format(**{arch: "\n".join(" " * 12 + line for line in lines)
                                         for arch, lines in DOC_LINES.items()})
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(jobs)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: (expected[name], answers, notes[name], root / name, models[name])
            for name, answers in zip(BUILDS, got, strict=True)}


@pytest.mark.parametrize("name", BUILDS)
def test_transformers_alone_generates_the_tokens_lavis_ds_generates(exports, name):
    expected, got, notes, _, _ = exports[name]
    assert notes == []  # nothing computes differently
    assert got == expected  # batch (left padding), second turn, two images in one prompt; finished rows padded alike
    # The comparison says something: the answers differ between images.
    assert len({tuple(row) for row in expected[0]}) > 1, expected[0]


def test_the_docs_hold_the_lines_the_test_runs():
    text = DOCS.read_text()
    missing = [line for lines in DOC_LINES.values() for line in lines if line not in text]
    assert not missing, f"docs/export-hf.md lacks: {missing}"


# ----------------------------------------------------------------------------- the ecosystem's one call
@pytest.fixture(scope="module")
def blip2_export(tiny_tokenizer_dir, tmp_path_factory) -> tuple[Path, nn.Module]:
    """A tiny blip2_qwen's export (its eps made transformers' one, so that the export computes what it does)."""
    from lavis_ds.models import Blip2Qwen

    cfg = Blip2Qwen.default_config("tiny") | {"tokenizer": str(tiny_tokenizer_dir)}
    torch.manual_seed(0)
    model = Blip2Qwen.from_config(cfg).eval()
    model.connector.ln_vision.eps = model.vision_tower.vit.blocks[0].norm1.eps
    with torch.no_grad():  # random weights answer alike whatever the image: make the image path count
        model.connector.llm_proj.weight.mul_(4)
    folder = tmp_path_factory.mktemp("blip2_hf") / "blip2"
    assert write_hf_folder(model, folder, {"name": "blip2_image_eval", "image_size": 64}) == []
    return folder, model


# Each family's export, called as model cards (and lmms-eval's `huggingface` model) call a folder. Qwen2-VL and
# Qwen2.5-VL: tests/test_qwen_vl_arch.py makes the same call.
ONE_CALL = ["blip2", *BUILDS]


def _assert_same_greedy(theirs: list[int], ours: list[int], scores: tuple[torch.Tensor, ...], where) -> None:
    """Greedy tokens equal, up to a tie: at the first step where they differ, the two tokens' scores under the
    export's own logits must be within 1e-4 (fp32 sums in another order can flip a tie of a random tiny model;
    after it the continuations differ by right). Any real difference in what the two compute is far above that."""
    step = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    if step is None:
        assert len(theirs) == len(ours), where
        return
    tie = float(scores[step][0, theirs[step]] - scores[step][0, ours[step]])
    assert abs(tie) < 1e-4, (where, step, theirs, ours, tie)


@pytest.mark.parametrize("name", ONE_CALL)
def test_the_ecosystem_s_one_call_generates_lavis_ds_s_tokens(exports, blip2_export, image_paths, name):
    """``AutoProcessor(folder)(images=, text=)`` then ``AutoModelForImageTextToText(folder).generate(**inputs)``: one
    prompt per call (lmms-eval's default batch), each image of another size, the processor's default backend.

    That backend (torchvision) resizes a uint8 tensor: its pixels are up to one grey level off lavis_ds's (PIL's
    bicubic; the README says so and ``backend="pil"`` gives them exactly, the tests above). One grey level can flip a
    greedy token of a random tiny model, so the pixels are checked against that bound, and lavis_ds generates from the
    processor's pixels: everything after the resize must agree to float precision."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lavis_ds.apps.export_hf_processor import default_image_cfg
    from lavis_ds.datasets.processor_sections import build_processor

    folder, model = blip2_export if name == "blip2" else exports[name][3:]
    processor = AutoProcessor.from_pretrained(folder)
    hf_model = AutoModelForImageTextToText.from_pretrained(folder)
    ours_pixels = build_processor(default_image_cfg(model))
    grey_level = 1 / 255 / torch.tensor(model.vision_tower.processing.std).view(3, 1, 1)
    render = (processor.apply_chat_template if name.startswith("llava") else processor.tokenizer.apply_chat_template)
    answers = []
    for path, question in zip(image_paths, QUESTIONS, strict=True):
        prompt = render([_user(None, question)], add_generation_prompt=True, tokenize=False)
        image = Image.open(path).convert("RGB")
        inputs = processor(images=[image], text=[prompt], return_tensors="pt")
        pixels = inputs["pixel_values"][0]
        assert ((pixels - ours_pixels(image)).abs() <= grey_level + 1e-5).all(), (name, path)
        # max_new_tokens as lmms-eval passes it: BLIP-2's class generates with its LLM's settings otherwise (README).
        out = hf_model.generate(**inputs, max_new_tokens=12, output_scores=True, return_dict_in_generate=True)
        new_tokens = out.sequences[:, inputs["input_ids"].shape[1]:].tolist()
        request = {"images": [path], "lavis_ds": {"prompts": [question], "answers": None, "num_images": [1]}}
        ours = _lavis_ds_token_ids(model, request, lambda _: pixels, max_new_tokens=12)[0]
        _assert_same_greedy(new_tokens[0], ours, out.scores, (name, question))
        answers.append(new_tokens[0])
    assert len({tuple(a) for a in answers}) > 1, answers  # the answers depend on the image and the question
    readme = (folder / "README.md").read_text()
    assert "processor(images=" in readme and "AutoModelForImageTextToText.from_pretrained(folder)" in readme
    assert "torchvision backend" in readme  # what the README says the one call computes otherwise


def test_the_one_call_gives_the_q_former_the_words_lavis_ds_gives_it(exports, image_paths, tiny_bert_tokenizer_dir):
    """The processor hands the Q-Former the whole prompt; the folder's qformer_tokenizer/ reads lavis_ds's instruction
    out of it: an instruction longer than max_instruction_len (32: truncated on the left), and a second turn after an
    answer (the Q-Former still reads the first question, which holds the image)."""
    from transformers import AutoProcessor, AutoTokenizer

    from lavis_ds.models.connectors.instruction import image_instructions, tokenize_instructions

    processor = AutoProcessor.from_pretrained(exports["instructblip"][3])
    bert = AutoTokenizer.from_pretrained(tiny_bert_tokenizer_dir, truncation_side="left")
    image = Image.open(image_paths[0]).convert("RGB")
    long_question = " ".join(["what color is the ball"] * 20)
    for turns, answers in [([long_question], []), ([QUESTIONS[1], QUESTIONS[2]], ["red"])]:
        messages = [_user(None, turns[0])]
        for answer, question in zip(answers, turns[1:]):
            messages += [{"role": "assistant", "content": answer}, _user(question)]
        prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        theirs = processor(images=[image], text=[prompt], return_tensors="pt")
        samples = {"instruction": [turns], "image": torch.zeros(1, 3, 64, 64)}
        ours = tokenize_instructions(bert, image_instructions(samples), 32)
        assert theirs["qformer_input_ids"].tolist() == ours["qformer_input_ids"].tolist(), turns


def test_the_instructblip_readme_says_what_the_one_call_does_otherwise(exports):
    readme = (exports["instructblip"][3] / "README.md").read_text()
    for difference in ("one image per prompt", "a batch of prompts", "truncated on the left at 32 tokens",
                       "`processor.apply_chat_template` fails", "torchvision backend"):
        assert difference in readme, difference


# ----------------------------------------------------------------------------- the folders
def test_the_llava_folder_holds_what_vllm_and_lmms_eval_read(exports):
    from transformers import AutoProcessor, LlavaConfig

    folder = exports["llava-clip"][3]
    config = LlavaConfig.from_pretrained(folder)
    assert config.architectures == ["LlavaForConditionalGeneration"]
    assert (config.vision_config.model_type, config.text_config.model_type) == ("clip_vision_model", "qwen2")
    # The tiny tower: 64 px in 16 px patches, CLS dropped, the penultimate layer.
    assert (config.image_seq_length, config.vision_feature_layer, config.vision_feature_select_strategy) == \
        (16, -2, "default")
    assert config.projector_hidden_act == "gelu" and config.multimodal_projector_bias
    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    assert type(processor).__name__ == "LlavaProcessor" and processor.patch_size == 16
    messages = [_user(None, QUESTIONS[0])]
    # vLLM and lmms-eval render with the processor's template: the same text as the tokenizer's, one image token
    # per image, which the processor expands to image_seq_length.
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|image_pad|>") == 1
    ids = processor(images=[Image.new("RGB", (64, 64))], text=[text]).input_ids[0]
    assert ids.count(config.image_token_index) == 16


@pytest.mark.parametrize("name, image_processor_class", [("llava-clip", "LlavaImageProcessor"),
                                                         ("llava-siglip", "SiglipImageProcessor"),
                                                         ("instructblip", "BlipImageProcessor")])
def test_the_folder_s_image_processor_gives_the_pixels_lavis_ds_evaluates_with(exports, image_paths, name,
                                                                                image_processor_class):
    """The tower's processing (CLIP padded to a square, SigLIP's statistics, EVA's square resize), as the export
    wrote it and transformers alone reads it, on images of other sizes and aspect ratios."""
    from transformers import AutoProcessor

    from lavis_ds.apps.export_hf_processor import default_image_cfg
    from lavis_ds.datasets.processor_sections import build_processor

    *_, folder, model = exports[name]
    theirs = AutoProcessor.from_pretrained(folder, backend="pil").image_processor
    assert type(theirs).__name__.startswith(image_processor_class)
    ours = build_processor(default_image_cfg(model))
    assert ours.processing == model.vision_tower.processing
    for path in image_paths:
        image = Image.open(path).convert("RGB")
        pixels = torch.as_tensor(np.asarray(theirs(image, return_tensors="pt").pixel_values[0]))
        assert torch.allclose(pixels, ours(image), rtol=0, atol=1e-5), path


def test_the_instructblip_folder_keeps_the_qformer_tokenizer_as_lavis_ds_uses_it(exports, tiny_bert_tokenizer_dir):
    from transformers import AutoProcessor, AutoTokenizer, InstructBlipConfig

    from lavis_ds.models.connectors.instruction import tokenize_instructions

    folder = exports["instructblip"][3]
    config = InstructBlipConfig.from_pretrained(folder)
    assert config.architectures == ["InstructBlipForConditionalGeneration"] and config.num_query_tokens == 8
    assert (folder / "qformer_tokenizer").is_dir()
    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    assert type(processor).__name__ == "InstructBlipProcessor"
    # LAVIS's settings: truncated on the left at max_instruction_len (32 in the tiny preset).
    long_text = " ".join(["what color is the ball"] * 20)
    theirs = processor.qformer_tokenizer([long_text, "a cat"], padding=True, truncation=True, return_tensors="pt")
    ours = tokenize_instructions(AutoTokenizer.from_pretrained(tiny_bert_tokenizer_dir, truncation_side="left"),
                                 [long_text, "a cat"], 32)
    assert torch.equal(theirs.input_ids, ours["qformer_input_ids"]) and theirs.input_ids.shape[1] == 32
    assert torch.equal(theirs.attention_mask, ours["qformer_attention_mask"])


@pytest.mark.parametrize("name", BUILDS)
def test_lavis_ds_reads_the_export_back_weight_for_weight(exports, name):
    """The mapping is the inverse of the one ``pretrained:`` reads published folders with (models.published)."""
    *_, folder, model = exports[name]
    cls = InstructBlip if name == "instructblip" else Llava
    cfg = {**cls.default_config("tiny"), "pretrained": str(folder), "load_pretrained": True}
    if name == "llava-siglip":
        cfg["vision_tower"] = {"name": "siglip", "preset": "tiny", "vision_config": {"image_size": 56, "patch_size": 14},
                               "vision_feature_layer": -1, "vision_feature_select_strategy": "full"}
    if name == "instructblip":
        cfg["connector"] = {k: v for k, v in cfg["connector"].items() if k != "qformer_tokenizer"}  # the folder's
    torch.manual_seed(1)  # another random init: everything must come from the folder
    back = cls.from_config(cfg).state_dict()
    ours = model.state_dict()
    assert back.keys() == ours.keys()
    assert [key for key in ours if not torch.equal(back[key], ours[key])] == []


# ----------------------------------------------------------------------------- export.py on trained runs
@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    """A tiny llava and a tiny instructblip trained one epoch on the demo data (ZeRO-2, one process)."""
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
    from run_utils import run_train, tiny_config, write_yaml

    root = tmp_path_factory.mktemp("trained_arch")
    storage = ensure_demo_shapes(root / "demo_shapes", DemoShapesSpec(num_train=32, num_val=8, num_test=8))
    runs = {}
    for arch in ("llava", "instructblip"):
        cfg = tiny_config(root / arch, storage, stage=2, micro=8, max_epoch=1, warmup_steps=1)
        cfg["datasets"]["demo_shapes"]["build_info"].update(num_train=32, num_val=8, num_test=8)
        cfg["model"]["arch"] = arch
        if arch == "instructblip":  # transformers' post_layernorm eps: the export computes what lavis_ds does
            cfg["model"]["connector"] = {"qformer_tokenizer": f"{storage}/qformer_tokenizer", "ln_vision_eps": 1e-6}
        run_train(write_yaml(root / f"{arch}.yaml", cfg), nproc=0)
        runs[arch] = root / arch
    return runs, storage


def _hf_generate(folder: Path, arch: str, images: list, questions: list[str]) -> list[list[int]]:
    """docs/export-hf.md's lines, in-process (the isolated run is the test above)."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder, backend="pil")
    hf_class = {"llava": "LlavaForConditionalGeneration", "instructblip": "InstructBlipForConditionalGeneration"}[arch]
    model = getattr(transformers, hf_class).from_pretrained(folder)
    prompts = [processor.tokenizer.apply_chat_template([_user(None, q)], add_generation_prompt=True, tokenize=False)
               for q in questions]
    if arch == "llava":
        inputs = processor(images=images, text=prompts, padding=True, return_tensors="pt")
    else:
        inputs = processor.tokenizer(prompts, padding=True, return_tensors="pt")
        qformer = processor.qformer_tokenizer(questions, padding=True, truncation=True, return_tensors="pt")
        inputs.update(pixel_values=processor.image_processor(images, return_tensors="pt").pixel_values,
                      qformer_input_ids=qformer.input_ids, qformer_attention_mask=qformer.attention_mask)
    output = model.generate(**inputs, generation_config=model.generation_config)
    return output[:, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("arch, hf_class", [("llava", "LlavaForConditionalGeneration"),
                                            ("instructblip", "InstructBlipForConditionalGeneration")])
def test_export_py_writes_a_trained_run_as_its_class(trained_runs, arch, hf_class, tmp_path, capsys):
    from lavis_ds.apps.export import export_checkpoint, load_exported, main
    from lavis_ds.apps.export_hf import MARKER_FILE
    from lavis_ds.apps.generation import eval_processors
    from lavis_ds.datasets.demo_shapes import COLOUR_QUESTION, SHAPE_QUESTION

    runs, storage = trained_runs
    assert main([str(runs[arch]), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert f"(transformers {hf_class})" in capsys.readouterr().out
    marker = json.loads((tmp_path / "hf" / MARKER_FILE).read_text())
    assert (marker["architecture"], marker["zero_stage"], marker["notes"]) == (hf_class, 2, [])

    model = load_exported(export_checkpoint(runs[arch], tmp_path / "lavis_ds"))
    vis, _ = eval_processors(tmp_path / "lavis_ds")
    paths = sorted((storage / "images").glob("test_*.png"))[:4]
    questions = [COLOUR_QUESTION, SHAPE_QUESTION, "Describe the image in a few words.", COLOUR_QUESTION]
    images = [Image.open(path).convert("RGB") for path in paths]
    request = {"images": [str(p) for p in paths], "lavis_ds": {"prompts": questions, "answers": None,
                                                               "num_images": [1] * 4}}
    expected = _lavis_ds_token_ids(model, request, vis)
    assert _hf_generate(tmp_path / "hf", arch, images, questions) == expected


# ----------------------------------------------------------------------------- lmms-eval on the LLaVA run
def test_lmms_eval_gives_the_same_answers_on_the_checkpoint_its_export_and_its_hf_export_with_llava_hf(
        trained_runs, tmp_path, monkeypatch):
    """The demo's caption task (projects/demo/lmms_eval, offline) by three paths: `lavis-ds eval` on the run's
    checkpoint, lavis_ds's model class on its export, and lmms-eval's own `llava_hf` on its `--format hf` export
    (which writes `<image>\\nquestion` into the chat template it was saved with): the same answers and score."""
    from lmms_eval import evaluator
    from lmms_eval.tasks import TaskManager

    from lavis_ds.apps.eval_model import PretrainedLavisDsLmms
    from lavis_ds.apps.export import export_checkpoint, main as export_main
    from lavis_ds.cli import main

    runs, storage = trained_runs
    tasks = Path(__file__).resolve().parent.parent / "projects" / "demo" / "lmms_eval"
    for name, value in (("LAVIS_DS_DEMO_DATA", str(storage)), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                        ("LMMS_EVAL_DATASETS_CACHE", str(tmp_path / "datasets_cache"))):
        monkeypatch.setenv(name, value)
    assert main(["eval", "--model", str(runs["llava"]), "--tasks", "demo_shapes_caption", "--include_path",
                 str(tasks), "--limit", "4", "--batch_size", "2", "--output_path", str(tmp_path / "run"),
                 "--log_samples"]) == 0
    [written] = (tmp_path / "run").glob("*/*_samples_demo_shapes_caption.jsonl")
    from_checkpoint = [json.loads(line)["filtered_resps"] for line in written.read_text().splitlines()]

    assert export_main([str(runs["llava"]), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    answers, scores = [], []
    for model, args in ((PretrainedLavisDsLmms.from_pretrained(export_checkpoint(runs["llava"], tmp_path / "lavis_ds"),
                                                               batch_size=4), None),
                        ("llava_hf", f"pretrained={tmp_path / 'hf'},device=cpu,device_map=cpu,dtype=float32")):
        result = evaluator.simple_evaluate(model=model, model_args=args, tasks=["demo_shapes_caption"], limit=4,
                                           task_manager=manager, log_samples=True)
        answers.append([s["filtered_resps"][0] for s in sorted(result["samples"]["demo_shapes_caption"],
                                                                key=lambda s: s["doc_id"])])
        scores.append(result["results"]["demo_shapes_caption"]["exact_match,none"])
    assert from_checkpoint == answers[0] == answers[1] and len(answers[0]) == 4
    [run_results] = (tmp_path / "run").glob("*/*_results.json")
    assert json.loads(run_results.read_text())["results"]["demo_shapes_caption"]["exact_match,none"] == \
        scores[0] == scores[1]



# ----------------------------------------------------------------------------- lmms-eval's own models on each export
# docs/models.md's lmms-eval column for these exports, row by row. lmms-eval's `huggingface` model fails in 0.7.3 for
# every folder: it renders with `processor.apply_chat_template`, which Blip2Processor and InstructBlipProcessor cannot
# (their __init__ hands ProcessorMixin no chat_template, so the saved chat_template.jinja is dropped on load; the
# tokenizer keeps it), and where that works it passes `audios=` to the processor, which transformers 5.24 refuses.
HUGGINGFACE_FAILS = {"llava-clip": r"keyword argument `audios` which is deprecated",
                     "blip2": r"this processor does not have a chat template",
                     "instructblip": r"this processor does not have a chat template"}
LMMS_EVAL_COLUMN = [("llava-clip", "llava_hf"), *[(name, "huggingface") for name in HUGGINGFACE_FAILS],
                    ("instructblip", "instructblip")]


@pytest.fixture(scope="module")
def lmms_eval_offline(trained_runs, tmp_path_factory):
    """The demo task's images: the demo data the trained runs above use."""
    from lmms_eval_runs import offline

    with offline(trained_runs[1], tmp_path_factory.mktemp("datasets_cache")):
        yield


@pytest.fixture(scope="module")
def lavis_ds_answers(exports, blip2_export, lmms_eval_offline):
    """``name -> (export folder, the answers lavis_ds's own lmms-eval model gives on the model the folder holds)``:
    ``LavisDsLmms``, the class `--model lavis_ds` builds, with the eval image processing lavis_ds generates with."""
    from lavis_ds.apps.export_hf_processor import default_image_cfg
    from lavis_ds.datasets.processor_sections import build_processor
    from lavis_ds.runners.lmms_eval.model import LavisDsLmms
    from lmms_eval_runs import caption_answers

    made = {}

    def get(name: str) -> tuple[Path, list[str]]:
        if name not in made:
            folder, model = blip2_export if name == "blip2" else exports[name][3:]
            made[name] = folder, caption_answers(LavisDsLmms(model, build_processor(default_image_cfg(model))))
        return made[name]
    return get


@pytest.mark.parametrize("name, lmms_model", LMMS_EVAL_COLUMN)
def test_lmms_eval_s_own_model_on_each_export_does_what_docs_models_md_says(lavis_ds_answers, name, lmms_model):
    """lmms-eval's model named in the table, on the `--format hf` export, over the demo's caption task (three images,
    one question), against `--model lavis_ds` (lavis_ds's lmms-eval model) on the same weights."""
    from transformers import AutoProcessor, InstructBlipForConditionalGeneration

    from lmms_eval_runs import CPU_ARGS, caption_answers, question

    folder, ours = lavis_ds_answers(name)
    assert len(set(ours)) > 1, ours  # lavis_ds's prompt holds the image: the answers depend on it
    model_args = f"pretrained={folder},{CPU_ARGS[lmms_model]}"
    if lmms_model == "huggingface":
        with pytest.raises(ValueError, match=HUGGINGFACE_FAILS[name]):
            caption_answers(lmms_model, model_args)
        if name in ("blip2", "instructblip"):  # the folder holds the template; the processor class drops it on load
            processor = AutoProcessor.from_pretrained(folder)
            assert (folder / "chat_template.jinja").is_file() and processor.tokenizer.chat_template is not None
            assert processor.chat_template is None
        return
    theirs = caption_answers(lmms_model, model_args)
    if lmms_model == "llava_hf":  # lavis_ds's answers (lavis_ds strips the whitespace around an answer)
        assert [answer.strip() for answer in theirs] == ours
        return
    # instructblip: the task's text alone, no chat template, so no image token in the prompt. The LLM never sees the
    # image: it continues the question's tokens, and lmms-eval's answer is the question followed by that continuation
    # (the class's generate returns the prompt's ids too, and lmms-eval decodes them all).
    processor = AutoProcessor.from_pretrained(folder)
    hf_model = InstructBlipForConditionalGeneration.from_pretrained(folder).eval()
    prompt = processor.tokenizer(question(), return_tensors="pt")
    continued = hf_model.language_model.generate(**prompt, max_new_tokens=12, do_sample=False)
    text_alone = processor.tokenizer.decode(continued[0], skip_special_tokens=True).strip()
    assert theirs == [text_alone] * len(ours) and text_alone.startswith(question())


def test_lavis_ds_eval_on_a_hf_export_says_which_folders_it_reads(exports, capsys):
    """`--model lavis_ds` (and `lavis-ds eval`) read lavis_ds's folders; a `--format hf` export is lmms-eval's own
    models' to read: one `lavis_ds:` line says so."""
    from lavis_ds.cli import main

    from lmms_eval_runs import TASK, TASKS

    folder = exports["llava-clip"][3]
    assert main(["eval", "--model", str(folder), "--tasks", TASK, "--include_path", str(TASKS), "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("lavis_ds:")] == err[-1:] and "Traceback" not in "\n".join(err)
    assert re.search(r"llava-clip is not a lavis_ds checkpoint but a transformers model's folder \(config\.json\), as "
                     r"`--format hf` writes: transformers and lmms-eval's own models read it .*lavis_ds reads the run "
                     r"it was exported from or its `--format lavis_ds` export", err[-1]), err[-1]
