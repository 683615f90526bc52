"""export.py --format hf: a transformers Blip2ForConditionalGeneration folder that generates what lavis_ds generates.

The main check trains the tiny demo model once (conftest's ``demo_export``), exports its checkpoint with
``--format hf``, and runs docs/export-hf.md's lines in a fresh interpreter where importing lavis_ds fails;
the token ids must be the ones lavis_ds.apps.generate produces from the same checkpoint. The other tests build
untrained tiny models in-process: the key mapping, the prompt, the pixels, and what is refused.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lavis_ds.datasets.demo_shapes import COLOUR_QUESTION, SHAPE_QUESTION
from lavis_ds.apps.export import ExportError, load_exported, main
from lavis_ds.apps.export_hf import MARKER_FILE, export_hf, to_hf_model, write_hf_folder
from lavis_ds.apps.export_hf_checks import check_expressible
from lavis_ds.models import Blip2Qwen
from lavis_ds.models.prompt import pad_batch

EVAL_IMAGES = {"name": "blip2_image_eval", "image_size": 64}
CAPTION = "Describe the image in a few words."
DOCS = Path(__file__).resolve().parent.parent / "docs" / "export-hf.md"

# docs/export-hf.md's lines, run as a transformers user runs them; the doc must hold each one (test below).
# `folder`, `images` (PIL) and `messages_list` are set by the script around them.
DOC_LINES = [
    'processor = AutoProcessor.from_pretrained(folder, backend="pil")',
    "model = Blip2ForConditionalGeneration.from_pretrained(folder)",
    "prompts = [processor.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) "
    "for m in messages_list]",
    'inputs = processor(images=images, text=prompts, padding=True, return_tensors="pt")',
    "output = model.generate(**inputs, generation_config=model.generation_config)",
    "new_tokens = output[:, inputs.input_ids.shape[1]:]",
]
# Run with importing lavis_ds made to fail: transformers, torch and PIL only.
TRANSFORMERS_ONLY = """
import json, sys
sys.modules["lavis_ds"] = None
from PIL import Image
from transformers import AutoProcessor, Blip2ForConditionalGeneration
folder, requests = sys.argv[1], json.loads(sys.argv[2])
answers = []
for request in requests:
    images = [Image.open(path) for path in request["images"]]
    messages_list = request["messages"]
{lines}
    answers.append({{"ids": new_tokens.tolist(),
                    "texts": processor.batch_decode(new_tokens, skip_special_tokens=True)}})
print(json.dumps(answers))
"""


def _messages(question: str | list[str], answers: list[str] = ()) -> list[dict]:
    """A chat as a transformers user writes it: the image with the first question, earlier answers as turns."""
    questions = [question] if isinstance(question, str) else question
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": questions[0]}]}]
    for answer, later in zip(answers, questions[1:]):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": later}]
    return messages


def _lavis_ds_token_ids(model, images, questions, answers=None, num_images=None
                        ) -> tuple[list[list[int]], list[str]]:
    """What lavis_ds.apps.generate generates, as token ids: its texts, and the ids its LLM's generate returned."""
    from lavis_ds.apps.generation import generate

    returned = []
    llm_generate = model.llm_model.generate
    model.llm_model.generate = lambda *a, **k: returned.append(llm_generate(*a, **k)) or returned[-1]
    try:
        texts = generate(model, images, questions, answers, num_images)
    finally:
        del model.llm_model.generate
    return returned[0].tolist(), texts


# ----------------------------------------------------------------------------- the trained demo, transformers only
@pytest.fixture(scope="module")
def demo_hf(demo_export, tmp_path_factory):
    """The demo run's checkpoint exported with ``export.py RUN --out DIR --format hf`` (in-process main)."""
    out = tmp_path_factory.mktemp("hf") / "demo_hf"
    assert main([str(demo_export.folder.parent / "run"), "--out", str(out), "--format", "hf"]) == 0
    return out


def test_transformers_alone_generates_the_tokens_lavis_ds_generates(demo_export, demo_hf):
    from PIL import Image

    from lavis_ds.apps.generation import eval_processors

    test = json.loads(demo_export.test_annotations.read_text())
    paths = [str(demo_export.storage / "images" / record["image"]) for record in test]
    questions = [CAPTION, COLOUR_QUESTION, SHAPE_QUESTION]
    # Four batches: the demo's test split with its caption prompt; prompts of different lengths (left padding);
    # a second turn after an answer (the history in the prompt); two images in one prompt beside a one-image prompt
    # (Blip2ForConditionalGeneration fills the image tokens with each image's queries in order; vLLM takes one).
    two = "<Img><ImageHere></Img> Compare <Img><ImageHere></Img> these two."
    batches = [(paths, [CAPTION] * len(paths), None, None),
               (paths[:6], [questions[i % 3] for i in range(6)], None, None),
               (paths[:2], [[COLOUR_QUESTION, SHAPE_QUESTION]] * 2, [["red"], ["blue"]], None),
               (paths[2:5], [two, SHAPE_QUESTION], None, [2, 1])]
    two_images = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare "},
                                               {"type": "image"}, {"type": "text", "text": "these two."}]}]
    requests = [{"images": p, "messages": [two_images if q == two else _messages(q, a or ())
                                           for q, a in zip(qs, answers or [()] * len(qs))]}
                for p, qs, answers, _ in batches]
    script = TRANSFORMERS_ONLY.format(lines="\n".join("    " + line for line in DOC_LINES))
    proc = subprocess.run([sys.executable, "-c", script, str(demo_hf), json.dumps(requests)], cwd=demo_hf.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    hf_answers = json.loads(proc.stdout.strip().splitlines()[-1])

    model = load_exported(demo_export.folder)
    vis, _ = eval_processors(demo_export.folder)
    for (p, qs, answers, num_images), hf in zip(batches, hf_answers, strict=True):
        images = torch.stack([vis(Image.open(path).convert("RGB")) for path in p])
        ids, texts = _lavis_ds_token_ids(model, images, qs, answers, num_images)
        assert hf["ids"] == ids  # the same batch: finished rows padded alike
        assert [text.strip() for text in hf["texts"]] == texts  # lavis_ds's generate strips the answers
    # The comparison says something: the trained demo answers in words, and about the image.
    captions = hf_answers[0]["texts"]
    assert all(captions) and len(set(captions)) > 1, captions


def test_the_folder_holds_what_transformers_reads(demo_hf):
    files = {p.name for p in demo_hf.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "processor_config.json", "chat_template.jinja", MARKER_FILE} <= files
    config = json.loads((demo_hf / "config.json").read_text())
    assert config["architectures"] == ["Blip2ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen2"
    assert config["num_query_tokens"] == 8 and config["vision_config"]["num_hidden_layers"] == 2
    tokenizer = json.loads((demo_hf / "tokenizer_config.json").read_text())
    assert tokenizer["image_token"] == "<|image_pad|>" and tokenizer["padding_side"] == "left"
    marker = json.loads((demo_hf / MARKER_FILE).read_text())
    assert marker["zero_stage"] == 2 and marker["dtype"] == "fp32" and marker["source"].endswith("step_96")


def test_the_docs_hold_the_lines_the_test_runs():
    text = DOCS.read_text()
    missing = [line for line in DOC_LINES if line not in text]
    assert not missing, f"docs/export-hf.md lacks: {missing}"


def test_export_refuses_to_replace_other_folders(demo_export, demo_hf, tmp_path):
    run = demo_export.folder.parent / "run"
    with pytest.raises(ExportError, match=r"already holds an export: .* --overwrite"):
        export_hf(run, demo_hf)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not an export")
    with pytest.raises(ExportError, match=rf"mine exists and is not a --format hf export folder \(no {MARKER_FILE}\)"):
        export_hf(run, tmp_path / "mine", overwrite=True)


def test_command_line_refusal_is_one_lavis_ds_message_and_exit_2(demo_export, tmp_path, monkeypatch, capsys):
    import lavis_ds.apps.export_hf as export_hf_module

    built = export_hf_module.trained_model
    monkeypatch.setattr(export_hf_module, "trained_model", lambda *a: _layer_scale(built(*a)))
    code = main([str(demo_export.folder.parent / "run"), "--out", str(tmp_path / "hf"), "--format", "hf"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("\nlavis_ds: cannot export as transformers' Blip2ForConditionalGeneration, which cannot express:\n"
            "  - vision_tower.vit.blocks.0: layer scale") in "\n" + err, err
    assert "Traceback" not in err and not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- untrained tiny models, in-process
@pytest.fixture
def tiny_model(tiny_model_config):
    torch.manual_seed(0)
    return Blip2Qwen.from_config(tiny_model_config).eval()


def test_the_converted_model_is_lavis_ds_s_bit_for_bit_when_the_norm_eps_agree(tiny_model):
    vit, ln_vision = tiny_model.vision_tower.vit, tiny_model.connector.ln_vision
    images = torch.randn(2, 3, 64, 64)
    ln_vision.eps = vit.blocks[0].norm1.eps  # Blip2VisionConfig has one eps (see test below for the default)
    hf = to_hf_model(tiny_model, torch.float32)
    input_ids, attention_mask = pad_batch([tiny_model.llm.prompt.generation_prompt(CAPTION)] * 2, 0, side="left")
    with torch.no_grad():
        assert torch.equal(hf.vision_model(images).last_hidden_state, ln_vision(vit(images)))
        assert torch.equal(hf.get_image_features(images).pooler_output, tiny_model.image_path.encode(images, {}))
        embeds = tiny_model.image_path.embed(input_ids, tiny_model.image_path.encode(images, {}))
        ours = tiny_model.llm_model(inputs_embeds=embeds, attention_mask=attention_mask).logits
        theirs = hf(pixel_values=images, input_ids=input_ids, attention_mask=attention_mask).logits
    assert torch.equal(theirs, ours)


def test_ln_vision_eps_is_the_one_difference_and_is_reported(tiny_model, tmp_path):
    notes = write_hf_folder(tiny_model, tmp_path, EVAL_IMAGES)
    assert len(notes) == 1 and notes[0].startswith("connector.ln_vision's LayerNorm eps 1e-05 becomes post_layernorm with "
                                                   "the ViT blocks' eps 1e-06"), notes


def test_a_bf16_run_is_written_and_loaded_in_bf16(tiny_model, tmp_path):
    from transformers import Blip2ForConditionalGeneration

    notes = write_hf_folder(tiny_model, tmp_path, EVAL_IMAGES, trained_dtype="bf16")
    assert any(n.startswith("written in bfloat16: lavis_ds generates under autocast, transformers does not:")
               for n in notes), notes
    hf = Blip2ForConditionalGeneration.from_pretrained(tmp_path)  # dtype="auto": config.dtype
    # As a bf16 engine casts every parameter (transformers keeps the Q-Former in fp32 for fp16 loads only).
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    inputs = {"pixel_values": torch.randn(1, 3, 64, 64), "input_ids": torch.tensor([[1] + [3] * 8 + [2]])}
    assert hf.generate(**inputs, max_new_tokens=2, generation_config=hf.generation_config).shape == (1, 12)


def test_the_mapping_inverts_the_one_lavis_ds_reads_hf_blip2_folders_with(tiny_model, tiny_model_config, tmp_path):
    write_hf_folder(tiny_model, tmp_path, EVAL_IMAGES)
    torch.manual_seed(1)
    other = Blip2Qwen.from_config(tiny_model_config)
    other.load_from_pretrained(str(tmp_path))  # lavis_ds.models.pretrained: HF_RENAMES and the qkv bias split
    theirs = other.state_dict()
    compared = [name for name in tiny_model.state_dict()
                if name.startswith(("vision_tower.vit.", "connector.ln_vision.", "connector.qformer.", "connector.query_tokens"))]
    assert len(compared) > 40 and all(torch.equal(theirs[n], tiny_model.state_dict()[n]) for n in compared)


def test_lora_token_rows_and_tied_embeddings_are_merged_and_generate_the_same(tiny_model_config, tmp_path):
    from lavis_ds.models.tokenizer import train_chatml_tokenizer
    from transformers import AutoTokenizer, Blip2ForConditionalGeneration

    from conftest import TINY_CORPUS

    # A tokenizer without ChatML tokens: the model adds them and trains their rows (TokenRowsEmbedding/Head).
    plain = train_chatml_tokenizer(TINY_CORPUS, tmp_path / "plain", vocab_size=400, special_tokens=["<|endoftext|>"])
    llm_config = tiny_model_config["llm_config"] | {"tie_word_embeddings": True}
    cfg = tiny_model_config | {"tokenizer": str(plain), "llm_config": llm_config, "get_lora": True,
                               "freeze_llm": True, "lora_r": 4}
    torch.manual_seed(0)
    model = Blip2Qwen.from_config(cfg).eval()
    with torch.no_grad():  # LoRA's B and the new rows start neutral: give the merge something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name or name.endswith(".rows"):
                param.normal_(std=0.5)
    model.connector.ln_vision.eps = model.vision_tower.vit.blocks[0].norm1.eps  # bit-exact features (see above)
    images = torch.randn(2, 3, 64, 64)
    questions = [CAPTION, SHAPE_QUESTION]
    expected, _ = _lavis_ds_token_ids(model, images, questions)

    model.merge_lora()
    write_hf_folder(model, tmp_path / "hf", EVAL_IMAGES)
    hf = Blip2ForConditionalGeneration.from_pretrained(tmp_path / "hf")
    llm = hf.language_model
    assert llm.get_output_embeddings().weight is llm.get_input_embeddings().weight
    assert not any("lora" in name for name, _ in hf.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompts = [tokenizer.apply_chat_template(_messages(q), add_generation_prompt=True, tokenize=False)
               for q in questions]
    inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    output = hf.generate(pixel_values=images, **inputs, generation_config=hf.generation_config)
    got = output[:, inputs.input_ids.shape[1]:].tolist()
    assert got == expected


def test_the_chat_template_writes_lavis_ds_s_prompt(tiny_model_config, tmp_path):
    from lavis_ds.apps.export_hf_processor import save_processor
    from transformers import AutoTokenizer

    # Quotes, Jinja syntax, a newline, a backslash, non-ASCII: the template must carry them unchanged.
    system = 'Say "hi" {{ and }} {% raw %}\n\\n ünïcødé 😀'
    model = Blip2Qwen.from_config(tiny_model_config | {"system_prompt": system})
    save_processor(model, EVAL_IMAGES, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)

    def ids(messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids

    prompt = model.llm.prompt
    assert ids(_messages(CAPTION)) == prompt.generation_prompt(CAPTION)
    assert ids(_messages([COLOUR_QUESTION, SHAPE_QUESTION], ["red"])) == \
        prompt.generation_prompt([COLOUR_QUESTION, SHAPE_QUESTION], ["red"])
    two_images = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a "},
                                               {"type": "image"}, {"type": "text", "text": "b"}]}]
    assert ids(two_images) == prompt.generation_prompt("<Img><ImageHere></Img> a <Img><ImageHere></Img> b",
                                                       num_images=2)
    # A conversation's own system message: as training sends a record's own system turn (ms-swift's example's, and
    # a Chinese one), under transformers alone; with the answer, the template's render is the training ids.
    for own in ("You are a useful and harmless assistant", "你是个有用无害的助手"):
        own_system = [{"role": "system", "content": own}] + _messages(CAPTION)
        assert ids(own_system) == prompt.generation_prompt(CAPTION, system=own)
        trained = [*own_system, {"role": "assistant", "content": "A red circle."}]
        text = tokenizer.apply_chat_template(trained, tokenize=False)
        assert tokenizer(text, add_special_tokens=False).input_ids == \
            prompt.training_example(f"<Img><ImageHere></Img> {CAPTION}", "A red circle.", system=own)[0]


@pytest.mark.parametrize("record_system", ["ignore", "fold"])
def test_the_chat_template_treats_a_system_message_as_training_treated_a_records(tiny_model_config, tmp_path,
                                                                                 record_system):
    from lavis_ds.apps.export_hf_processor import save_processor
    from transformers import AutoTokenizer

    model = Blip2Qwen.from_config(tiny_model_config | {"record_system_prompt": record_system})
    save_processor(model, EVAL_IMAGES, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    own = "You are a useful and harmless math calculator"
    messages = [{"role": "system", "content": own}, *_messages(["What is 1 + 1?", "What about adding 1?"],
                                                                ["It equals 2"])]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = model.llm.prompt.generation_prompt(["<Img><ImageHere></Img> What is 1 + 1?", "What about adding 1?"],
                                              ["It equals 2"], system=own)
    assert tokenizer(text, add_special_tokens=False).input_ids == expected
    assert (own in text) == (record_system == "fold")


def test_the_image_processor_gives_lavis_ds_s_pixels(tiny_model, tmp_path):
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from lavis_ds.apps.export_hf_processor import save_processor
    from lavis_ds.processors.image import Blip2ImageEvalProcessor

    section = {"name": "blip2_image_eval", "image_size": 48, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]}
    save_processor(tiny_model, section, tmp_path)
    processor = AutoProcessor.from_pretrained(tmp_path, backend="pil")
    ours = Blip2ImageEvalProcessor(image_size=48, mean=section["mean"], std=section["std"])
    rng = np.random.default_rng(0)
    # Not RGBA: transformers composites transparency onto white, lavis_ds (PIL's convert) drops it; the docs say
    # to convert("RGB") first, as lavis_ds reads images.
    for (height, width), mode in [((80, 100), "RGB"), ((48, 48), "RGB"), ((31, 57), "RGB"), ((200, 120), "L")]:
        shape = (height, width) if mode == "L" else (height, width, len(mode))
        image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)
        pixels = processor.image_processor(image, return_tensors="pt").pixel_values[0]
        assert torch.equal(pixels, ours(image)), (height, width, mode)


# ----------------------------------------------------------------------------- what is refused
def _layer_scale(model):
    model.vision_tower.vit.blocks[0].gamma_1 = nn.Parameter(torch.ones(64))
    return model


def _rope(model):
    model.vision_tower.vit.rope = nn.Identity()  # what it is does not matter: Blip2VisionModel has none
    return model


def _silu(model):
    model.vision_tower.vit.blocks[1].mlp.act = nn.SiLU()
    return model


def _rms_norm(model):
    from timm.layers import RmsNorm

    model.vision_tower.vit.blocks[0].norm1 = RmsNorm(64)
    return model


def _swiglu(model):
    from timm.layers import SwiGLU

    model.vision_tower.vit.blocks[0].mlp = SwiGLU(64, 128)
    return model


def _post_norm(model):
    from timm.models.eva import EvaBlockPostNorm

    model.vision_tower.vit.blocks[1].__class__ = EvaBlockPostNorm
    return model


def _subclassed_llm(model):
    from transformers import Qwen2ForCausalLM

    class PatchedQwen2(Qwen2ForCausalLM):
        pass

    model.llm_model.__class__ = PatchedQwen2
    return model


@pytest.mark.parametrize("change, message", [
    (_layer_scale, r"vision_tower\.vit\.blocks\.0: layer scale \(gamma_1/gamma_2, init_values\)"),
    (_rope, r"vision_tower\.vit: rotary position embedding \(rope\)"),
    (_silu, r"vision_tower\.vit\.blocks\.1\.mlp\.act: SiLU\(\); Blip2MLP's activations"),
    (_rms_norm, r"vision_tower\.vit\.blocks\.0\.norm1: RmsNorm"),
    (_swiglu, r"vision_tower\.vit\.blocks\.0\.mlp: SwiGLU; Blip2MLP is fc1 -> activation -> fc2"),
    (_post_norm, r"vision_tower\.vit\.blocks\.1: EvaBlockPostNorm; Blip2EncoderLayer is EvaBlock's pre-norm layout"),
    (_subclassed_llm, r"llm_model: PatchedQwen2, but text_config model_type 'qwen2' builds Qwen2ForCausalLM"),
])
def test_what_blip2_cannot_express_is_refused(tiny_model, change, message):
    with pytest.raises(ExportError, match=r"cannot export as transformers' Blip2ForConditionalGeneration, which "
                                          r"cannot express:\n  - " + message):
        check_expressible(change(tiny_model), EVAL_IMAGES)


def test_every_problem_is_reported_at_once(tiny_model):
    with pytest.raises(ExportError) as refused:
        check_expressible(_silu(_layer_scale(tiny_model)), {"name": "my_resize_crop", "image_size": 64})
    lines = str(refused.value).splitlines()[1:]
    assert len(lines) == 3 and "layer scale" in lines[0] and "SiLU" in lines[1] and "'my_resize_crop'" in lines[2]


def test_a_model_that_is_not_composed_of_parts_is_refused():
    from lavis_ds.models.eva_vit import EvaViT

    vit = EvaViT(img_size=32, patch_size=16, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ExportError, match=r"EvaViT is not a vision_tower \+ connector architecture; export it with "
                                          r"--format lavis_ds"):
        check_expressible(vit, EVAL_IMAGES)
