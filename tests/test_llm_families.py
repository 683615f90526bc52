"""Other LLM families in the LLM slot: tiny Qwen3, Llama 3 and Gemma 2 models with their families' chat templates.

In-process: each family trains a step, generates, shards by its own decoder layers, takes LoRA on the
linear layers it really has and merges back into its plain transformers class. On 2 processes: a tiny
Qwen3 and a tiny Llama 3 folder train through train.py on DeepSpeed ZeRO-3 (built partitioned) and on
FSDP, checkpoint, resume exactly, and (Llama) export.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from families import FAMILIES, model_folder, tokenizer_dir
from lavis_ds.models import Blip2Qwen
from lavis_ds.models.llm_families import decoder_layers, llm_config_problems
from lavis_ds.models.settings.base import model_settings
from run_utils import comparable, export_matches_logged_val_loss, run_train, tiny_config, train_steps, write_yaml

IN_PROCESS = ["qwen3", "llama3.2", "gemma2"]
LAYER_CLASSES = {"qwen3": "Qwen3DecoderLayer", "llama3.2": "LlamaDecoderLayer", "gemma2": "Gemma2DecoderLayer"}
LLM_CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama3.2": "LlamaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
SAMPLES = {"instruction": [["<Img><ImageHere></Img> What is in the image?"], ["Describe it.", "What color?"]],
           "output": [["A cat sitting on a mat."], ["A dog runs on the grass.", "It is red."]]}


def samples() -> dict:
    return {"image": torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)), **SAMPLES}


def tiny(name: str, tokenizer, **overrides) -> Blip2Qwen:
    """The `tiny` preset with a random-init LLM of family ``name`` (llm_config.model_type) and its tokenizer."""
    cfg = Blip2Qwen.default_config("tiny")
    cfg.update(tokenizer=str(tokenizer), **{**FAMILIES[name].model, **overrides})
    cfg["llm_config"] = {**cfg["llm_config"], "model_type": FAMILIES[name].model_type, "head_dim": 16}
    torch.manual_seed(0)
    return Blip2Qwen.from_config(cfg)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_tokenizers")
    return {name: tokenizer_dir(root / name, name) for name in IN_PROCESS}


@pytest.mark.parametrize("name", IN_PROCESS)
def test_each_family_trains_generates_and_shards_by_its_own_decoder_layers(tokenizers, name):
    model = tiny(name, tokenizers[name])
    assert type(model.llm_model).__name__ == LLM_CLASSES[name]
    model.train()
    out = model(samples())
    out["loss"].backward()
    assert math.isfinite(out["loss"].item()) and model.connector.llm_proj.weight.grad.abs().sum() > 0
    llm_blocks = model.repeated_blocks()[-2:]
    assert [type(b).__name__ for b in llm_blocks] == [LAYER_CLASSES[name]] * 2
    eot = model.llm.tokenizer.convert_tokens_to_ids(FAMILIES[name].end_of_turn)
    assert model.llm.end_of_turn_id == eot
    model.eval()
    answers = model.generate({**samples(), "output": [[], ["A dog runs on the grass."]]}, max_new_tokens=4)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_lora_targets_the_linear_layers_the_family_has_and_merges_into_its_class(tokenizers, name):
    model = tiny(name, tokenizers[name], freeze_llm=True, get_lora=True, lora_r=4)
    targets = set(model.llm_model.peft_config["default"].target_modules)
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with torch.no_grad():  # LoRA starts as the identity: move it so that merging has something to fold in
        for module in model.llm_model.modules():
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.normal_(std=0.02)
    model.eval()
    before = model(samples())["loss"]
    merged = model.merge_lora()
    assert type(merged).__name__ == LLM_CLASSES[name]
    torch.testing.assert_close(model(samples())["loss"], before, rtol=1e-5, atol=1e-5)


def test_unknown_or_non_causal_model_type_is_a_config_problem_with_a_suggestion():
    assert llm_config_problems({"model_type": "llama"}) == [] and llm_config_problems(None) == []
    [unknown] = model_settings(Blip2Qwen, {"tokenizer": "t", "llm_config": {"model_type": "lama"}}).problems()
    assert "model.llm_config.model_type: unknown model_type 'lama'" in unknown and "'llama'" in unknown
    [not_causal] = llm_config_problems({"model_type": "vit"})
    assert "is not a causal language model" in not_causal
    # A folder decides the architecture itself: llm_config is not checked then.
    assert model_settings(Blip2Qwen, {"llm_model": "folder", "llm_config": {"model_type": "lama"}}).problems() == []


def test_decoder_layers_without_a_layers_list_come_from_no_split_modules():
    class Block(nn.Module):
        pass

    class Stack(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList([Block(), Block()])

    stack = Stack()
    assert decoder_layers(stack) == list(stack.h)
    stack._no_split_modules = []
    with pytest.raises(ValueError, match="cannot find the decoder layers of Stack"):
        decoder_layers(stack)


# ----------------------------------------------------------------- exports prompt as training did
QUESTIONS, ANSWERS = ["What is in the image?", "What color is it?"], ["A cat."]


def _chat(system: str | None) -> list[dict]:
    """A transformers user's conversation: the image with the first question, an answer, a second question."""
    chat = [{"role": "system", "content": system}] if system else []
    return chat + [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]},
                   {"role": "assistant", "content": ANSWERS[0]}, {"role": "user", "content": QUESTIONS[1]}]


@pytest.mark.parametrize("record_system", ["use", "fold"])
def test_the_hf_export_prompts_with_the_run_s_template_variables_by_default(tokenizers, tmp_path, record_system):
    """A Qwen3 LLM trained with enable_thinking: false: AutoProcessor's tokenizer renders the empty think block
    training wrote, with no argument, and processor(images=, text=) gives ChatPrompt's ids; enable_thinking=True
    still renders the thinking prompt, as ChatPrompt would have."""
    import dataclasses

    from PIL import Image
    from transformers import AutoProcessor

    from lavis_ds.apps.export_hf_processor import save_processor

    model = tiny("qwen3", tokenizers["qwen3"], record_system_prompt=record_system)
    carried = save_processor(model, {"name": "blip2_image_eval", "image_size": 64}, tmp_path)
    assert carried.carried == {"enable_thinking": False} and carried.notes == []
    processor = AutoProcessor.from_pretrained(tmp_path, backend="pil")
    image = Image.new("RGB", (80, 60), (200, 30, 30))
    thinking = dataclasses.replace(model.llm.prompt, template_variables={"enable_thinking": True})
    instructions = [f"<Img><ImageHere></Img> {QUESTIONS[0]}", QUESTIONS[1]]
    for system in (None, "You are a terse captioner."):
        texts = []
        for prompt, variables in ((model.llm.prompt, {}), (thinking, {"enable_thinking": True})):
            texts.append(processor.tokenizer.apply_chat_template(_chat(system), add_generation_prompt=True,
                                                                 tokenize=False, **variables))
            ids = processor(images=[image], text=texts[-1:]).input_ids[0]
            assert list(ids) == prompt.generation_prompt(instructions, ANSWERS, system=system)
        assert texts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # as trained: thinking off
        assert texts[1].endswith("<|im_start|>assistant\n")


def test_the_hf_export_names_a_template_variable_it_cannot_default_to(tokenizers, tmp_path):
    """A run that put a tool list in every prompt: transformers passes `tools` itself, so the template cannot default
    to it; the export's notes and README say so, and passing it renders the trained prompt."""
    from transformers import AutoTokenizer

    from lavis_ds.apps.export_hf import write_hf_folder

    tools = [{"type": "function", "function": {"name": "count_shapes", "parameters": {}}}]
    model = tiny("qwen3", tokenizers["qwen3"], chat_template_kwargs={"enable_thinking": False, "tools": tools})
    model.merge_lora()
    notes = write_hf_folder(model.eval(), tmp_path)
    named = [note for note in notes if "model.chat_template_kwargs.tools" in note]
    assert len(named) == 1 and "transformers passes that variable" in named[0]
    readme = (tmp_path / "README.md").read_text()
    assert named[0] in readme and "`enable_thinking=False`" in readme
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = tokenizer.apply_chat_template(_chat(None), add_generation_prompt=True, tokenize=False, tools=tools)
    assert tokenizer(text, add_special_tokens=False).input_ids == model.llm.prompt.generation_prompt(
        [f"<Img><ImageHere></Img> {QUESTIONS[0]}", QUESTIONS[1]], ANSWERS)


@pytest.mark.parametrize("name", ["qwen3", "llama3.2"])
def test_the_exported_tokenizer_defaults_to_the_run_s_template_variables(tokenizers, tmp_path, name):
    """export.py's tokenizer/ and llm/ (``save_tokenizer_with_defaults``): tokenizer.apply_chat_template without
    arguments renders ChatPrompt's text-only prompt (Qwen3 without thinking, Llama 3.2 with the trained date, not
    today's); the tokenizer handed in keeps its template."""
    from transformers import AutoTokenizer

    from lavis_ds.models.prompt import ChatPrompt
    from lavis_ds.models.template_defaults import save_tokenizer_with_defaults

    variables = FAMILIES[name].model["chat_template_kwargs"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[name])
    published = tokenizer.chat_template
    assert save_tokenizer_with_defaults(tokenizer, variables, tmp_path) == []
    assert tokenizer.chat_template == published
    saved = AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": ANSWERS[0]}, {"role": "user", "content": QUESTIONS[1]}]
    prompt = ChatPrompt(tokenizer, "Be brief.", "<|image_pad|>", 0, 512, variables)
    expected = prompt.generation_prompt(QUESTIONS, ANSWERS, num_images=0)
    assert saved.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False) == expected
    untouched = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert untouched != expected  # without the variables the published template prompts otherwise


def test_the_merged_llm_folder_s_tokenizer_prompts_as_training_did(tokenizers, tmp_path):
    """export.py --merge-lora's llm/ (``_merge_llm``) for a Qwen3 run with enable_thinking: false: its tokenizer's
    default render is the trained prompt format, and the config it returns still passes the variable."""
    from transformers import AutoTokenizer

    from lavis_ds.apps.export import MERGED_LLM_DIR, _merge_llm

    model = tiny("qwen3", tokenizers["qwen3"])
    cfg = {**Blip2Qwen.default_config("tiny"), "arch": "blip2_qwen", "tokenizer": str(tokenizers["qwen3"]),
           **FAMILIES["qwen3"].model}
    cfg["llm_config"] = {**cfg["llm_config"], "model_type": "qwen3", "head_dim": 16}
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    _, merged_cfg, notes = _merge_llm(weights, cfg, 0, tmp_path, tmp_path)
    assert notes == [] and merged_cfg["chat_template_kwargs"] == {"enable_thinking": False}
    chat = [{"role": "system", "content": model.llm.prompt.system_prompt}, {"role": "user", "content": QUESTIONS[0]}]
    text = AutoTokenizer.from_pretrained(tmp_path / MERGED_LLM_DIR).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert model.llm.tokenizer(text, add_special_tokens=False).input_ids == model.llm.prompt.generation_prompt(
        QUESTIONS[0], num_images=0)


# ----------------------------------------------------------------- train.py on 2 processes
NUM_TRAIN = 8  # micro-batch 2 x 2 processes: 2 optimizer steps
FROZEN_LORA = dict(freeze_vit=True, freeze_qformer=True, freeze_queries=True, freeze_llm=True, get_lora=True,
                   lora_r=4, lora_alpha=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

    root = tmp_path_factory.mktemp("family_runs")
    storage = ensure_demo_shapes(root / "demo_shapes", DemoShapesSpec(num_train=NUM_TRAIN, num_val=2, num_test=2))
    return root, storage, {name: model_folder(root / name, name) for name in ("qwen3", "llama3.2")}


def _config(out, storage, folder, name: str, runner: str, **run) -> dict:
    cfg = tiny_config(out, storage, stage=3, micro=2, init_lr=1e-2, warmup_steps=0, runner=runner, **run)
    cfg["model"].update(llm_model=str(folder), tokenizer=None, **FROZEN_LORA, **FAMILIES[name].model)
    return cfg


@pytest.mark.parametrize("runner", ["runner_deepspeed", "runner_fsdp"])
@pytest.mark.parametrize("name", ["qwen3", "llama3.2"])
def test_family_folder_trains_and_resumes_exactly_through_train_py(setup, tmp_path, name, runner):
    """LoRA on a frozen tiny Qwen3 / Llama 3 folder (ZeRO-3 builds it partitioned), its real chat template: two
    steps with a checkpoint after each, then a run resumed from step 1 takes step 2 exactly as the first did."""
    root, storage, folders = setup
    out = tmp_path / "run"
    run_train(write_yaml(tmp_path / "run.yaml", _config(out, storage, folders[name], name, runner,
                                                        save_freq_steps=1, valid_splits=["val"], batch_size_eval=2)))
    steps = train_steps(out)
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)

    resumed_out = tmp_path / "resumed"
    resumed = _config(resumed_out, storage, folders[name], name, runner, resume=str(out / "checkpoints" / "step_1"))
    proc = run_train(write_yaml(tmp_path / "resumed.yaml", resumed))
    assert "resumed from" in proc.stdout
    assert comparable(train_steps(resumed_out)) == comparable(steps[1:])
    if name == "llama3.2" and runner == "runner_deepspeed":
        _exported_model_has_the_logged_validation_loss(out, tmp_path / "export", storage)


def _exported_model_has_the_logged_validation_loss(out, export_dir, storage) -> None:
    """Export with LoRA merged into a plain LlamaForCausalLM: the validation loss the run logged at its end."""
    merged = export_matches_logged_val_loss(out, export_dir, storage)
    assert type(merged.llm_model).__name__ == "LlamaForCausalLM"


def test_the_hf_export_refuses_a_family_whose_prompt_is_not_chatml(tokenizers):
    """The HF folder's chat template is lavis_ds's ChatML: a Llama-3 model is named, not exported to be prompted
    in another format than it trained on; Qwen's template renders ChatML and passes this check."""
    from lavis_ds.apps.export_hf_checks import _prompt_problems

    llama = tiny("llama3.2", tokenizers["llama3.2"])
    assert "ends its turns with '<|eot_id|>', not ChatML's <|im_end|>" in _prompt_problems(llama)[0]
    assert _prompt_problems(tiny("qwen3", tokenizers["qwen3"])) == []
