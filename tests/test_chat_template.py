"""Prompts rendered by real chat templates (tests/fixtures/chat_templates, copied from the families' published
tokenizer_config.json files) and the answer-only mask derived from the render, family by family."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from families import FAMILIES, TEMPLATES, tokenizer_dir
from lavis_ds.models.chat_template import ChatTemplateError
from lavis_ds.models.llm import prepare_tokenizer
from lavis_ds.models.prompt import IGNORE_INDEX, ChatPrompt
from lavis_ds.models.tokenizer import train_family_tokenizer
from conftest import TINY_CORPUS

SYSTEM = "You are a helpful assistant."
N_IMG = 4
QUESTIONS = ["<Img><ImageHere></Img> What is in the image?", "What color is the ball?", "How many animals are there?"]
ANSWERS = ["A dog runs on the grass.", "It is red.", "Two."]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: prepare_tokenizer(tokenizer_dir(root / name, name), FAMILIES[name].model.get(
        "image_token", "<|image_pad|>"))[0] for name in FAMILIES}


def chat_prompt(tokenizers, name: str, **overrides) -> ChatPrompt:
    model = {"system_prompt": SYSTEM, "image_token": "<|image_pad|>", "chat_template_kwargs": {},
             **FAMILIES[name].model, **overrides}
    return ChatPrompt(tokenizers[name], model["system_prompt"], model["image_token"], N_IMG, 4096,
                      model["chat_template_kwargs"], model.get("record_system_prompt", "use"))


def supervised_runs(tokenizer, ids, labels) -> list[str]:
    runs = []
    for supervised, group in itertools.groupby(zip(ids, labels), key=lambda p: p[1] != IGNORE_INDEX):
        pairs = list(group)
        if supervised:
            assert all(i == label for i, label in pairs)
            runs.append(tokenizer.decode([i for i, _ in pairs]))
    return runs


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("turns", [1, 3])
def test_supervised_tokens_are_the_answers_and_the_end_of_turn_token(tokenizers, name, turns):
    prompt = chat_prompt(tokenizers, name)
    ids, labels = prompt.training_example(QUESTIONS[:turns], ANSWERS[:turns])
    eot = FAMILIES[name].end_of_turn
    assert supervised_runs(tokenizers[name], ids, labels) == [answer + eot for answer in ANSWERS[:turns]]
    assert ids.count(prompt.image_token_id) == N_IMG
    assert prompt.end_of_turn_id == tokenizers[name].convert_tokens_to_ids(eot)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_prompt_is_the_templates_own_render_and_generation_sees_the_training_prefix(tokenizers, name):
    prompt, tokenizer = chat_prompt(tokenizers, name), tokenizers[name]
    ids, _ = prompt.training_example(QUESTIONS, ANSWERS)
    turns = [q.replace("<ImageHere>", prompt.image_token * N_IMG) for q in QUESTIONS]
    messages = [] if prompt.system_prompt is None else [{"role": "system", "content": SYSTEM}]
    for question, answer in zip(turns, ANSWERS):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    variables = dict(prompt.template_variables)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False, **variables)

    generation = prompt.generation_prompt(QUESTIONS, ANSWERS[:2])
    assert ids[:len(generation)] == generation
    assert tokenizer.decode(generation) == tokenizer.apply_chat_template(messages[:-1], tokenize=False,
                                                                         add_generation_prompt=True, **variables)


def test_qwen25_template_gives_the_ids_of_the_chatml_lavis_ds_writes(tokenizers):
    """A Qwen2.5 folder's own template and the ChatML written for a tokenizer without one: the same tokens."""
    with_template = chat_prompt(tokenizers, "qwen2.5")
    bare = AutoTokenizer.from_pretrained(tokenizers["qwen2.5"].name_or_path)
    bare.chat_template = None
    without = ChatPrompt(bare, SYSTEM, "<|image_pad|>", N_IMG, 4096)
    for turns in (1, 3):
        assert with_template.training_example(QUESTIONS[:turns], ANSWERS[:turns]) == \
            without.training_example(QUESTIONS[:turns], ANSWERS[:turns])
        assert with_template.generation_prompt(QUESTIONS[:turns], ANSWERS) == \
            without.generation_prompt(QUESTIONS[:turns], ANSWERS)


def test_qwen3_drops_the_empty_think_block_from_history_turns(tokenizers):
    prompt, tokenizer = chat_prompt(tokenizers, "qwen3"), tokenizers["qwen3"]
    ids, _ = prompt.training_example(QUESTIONS[:2], ANSWERS[:2])
    text = tokenizer.decode(ids)
    assert f"<|im_start|>assistant\n{ANSWERS[0]}<|im_end|>" in text  # history form: no think block
    assert f"<|im_start|>assistant\n<think>\n\n</think>\n\n{ANSWERS[1]}<|im_end|>" in text  # as generation sees it


def test_qwen3_in_thinking_mode_supervises_the_empty_think_block_of_the_last_answer(tokenizers):
    """Without enable_thinking: false the generation header is bare, so the answer starts with the think block."""
    prompt = chat_prompt(tokenizers, "qwen3", chat_template_kwargs={})
    ids, labels = prompt.training_example(QUESTIONS[:2], ANSWERS[:2])
    assert supervised_runs(tokenizers["qwen3"], ids, labels) == [
        ANSWERS[0] + "<|im_end|>", "<think>\n\n</think>\n\n" + ANSWERS[1] + "<|im_end|>"]


def test_llama_date_comes_from_the_variables(tokenizers):
    ids, _ = chat_prompt(tokenizers, "llama3.2").training_example(QUESTIONS[:1], ANSWERS[:1])
    assert "Today Date: 26 Jul 2024\n\nYou are a helpful assistant.<|eot_id|>" in tokenizers["llama3.2"].decode(ids)


def test_gemma_refuses_a_system_message_and_says_how_to_leave_it_out(tokenizers):
    prompt = chat_prompt(tokenizers, "gemma2", system_prompt=SYSTEM)
    with pytest.raises(ChatTemplateError, match=r"System role not supported; .*set model.system_prompt: null"):
        prompt.training_example(QUESTIONS[:1], ANSWERS[:1])


OWN_SYSTEM = "You are a useful and harmless math calculator"  # ms-swift's example (tests/fixtures/chat_messages)


@pytest.mark.parametrize("name", [name for name in FAMILIES if name != "gemma2"])
def test_a_samples_own_system_turn_renders_as_the_models_own_system_prompt_would(tokenizers, name):
    prompt = chat_prompt(tokenizers, name)
    as_configured = chat_prompt(tokenizers, name, system_prompt=OWN_SYSTEM)
    for turns in (1, 2):
        own = prompt.training_example(QUESTIONS[:turns], ANSWERS[:turns], system=OWN_SYSTEM)
        assert own == as_configured.training_example(QUESTIONS[:turns], ANSWERS[:turns])
        assert own != prompt.training_example(QUESTIONS[:turns], ANSWERS[:turns])
        assert prompt.generation_prompt(QUESTIONS[:turns], ANSWERS[:turns - 1], system=OWN_SYSTEM) == \
            as_configured.generation_prompt(QUESTIONS[:turns], ANSWERS[:turns - 1])
    ignoring = chat_prompt(tokenizers, name, record_system_prompt="ignore")
    assert ignoring.training_example(QUESTIONS[:1], ANSWERS[:1], system=OWN_SYSTEM) == \
        prompt.training_example(QUESTIONS[:1], ANSWERS[:1])


def test_gemma_refuses_a_records_system_turn_naming_the_record_unless_folded(tokenizers, tmp_path):
    from lavis_ds.common import registry as reg
    from lavis_ds.models.vision_llm_batch import token_batch

    quoted = Path(__file__).parent / "fixtures" / "chat_messages" / "swift_sft_en.jsonl"  # ms-swift's own examples
    section = {"builder": "chat_messages", "build_info": {"annotations": {"train": {"storage": str(quoted)}},
                                                          "images": {"storage": str(tmp_path)}}}
    train = reg.builders.get("chat_messages")(section).build()["train"]
    prompt = chat_prompt(tokenizers, "gemma2")
    with pytest.raises(ChatTemplateError, match=r"swift_sft_en\.jsonl: record 1: the chat template of '.*gemma2' takes "
                                                r"no system message, and the sample has its own \('You are a useful "
                                                r"and harmless math calculator'\); set model.record_system_prompt: "
                                                r"fold"):
        token_batch(prompt, train.collater([train[1]]), 0)
    folded = chat_prompt(tokenizers, "gemma2", record_system_prompt="fold")
    ids, _ = folded.training_example(QUESTIONS[:1], ANSWERS[:1], system=OWN_SYSTEM)
    # Gemma's own way with a system message (Gemma 3's template): its text and a blank line open the first user turn
    assert ids == prompt.training_example([f"{OWN_SYSTEM}\n\n{QUESTIONS[0]}"], ANSWERS[:1])[0]
    assert tokenizers["gemma2"].decode(ids).startswith(f"<bos><start_of_turn>user\n{OWN_SYSTEM}\n\n<Img>")
    # a batch without a file's records (built in code) names the sample by its index
    samples = {"instruction": [QUESTIONS[:1]], "output": [ANSWERS[:1]], "num_images": [1],
               "image": torch.zeros(1, 3, 4, 4), "system": [OWN_SYSTEM], "index": [7]}
    with pytest.raises(ChatTemplateError,
                       match=r"^sample 0 of the micro-batch \(dataset index 7\): the chat template of"):
        token_batch(prompt, samples, 0)


def test_a_template_that_breaks_the_prefix_property_is_refused(tmp_path):
    """Phi-3.5 ends a render without generation prompt with eos: the answer cannot be told apart exactly."""
    folder = train_family_tokenizer("phi3", TINY_CORPUS, tmp_path, (TEMPLATES / "phi-3.5-mini-instruct.jinja")
                                    .read_text(), vocab_size=400)
    tokenizer, _ = prepare_tokenizer(folder, "<|image_pad|>")
    prompt = ChatPrompt(tokenizer, SYSTEM, "<|image_pad|>", N_IMG, 4096)
    with pytest.raises(ChatTemplateError, match="breaks the prefix property: adding the generation prompt"):
        prompt.training_example(QUESTIONS[:1], ANSWERS[:1])


GENERATION_TEMPLATE = (  # Qwen2.5's turns, with the assistant's text and end-of-turn marked as generated
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message.content + '<|im_end|>' + tail }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("tail", ["", "!"])
def test_generation_blocks_are_the_supervised_spans_as_the_template_marks_them(tmp_path, tail):
    folder = train_family_tokenizer("qwen2.5", TINY_CORPUS, tmp_path, GENERATION_TEMPLATE, vocab_size=400)
    tokenizer, _ = prepare_tokenizer(folder, "<|image_pad|>")
    prompt = ChatPrompt(tokenizer, SYSTEM, "<|image_pad|>", N_IMG, 4096, {"tail": tail})
    ids, labels = prompt.training_example(QUESTIONS[:2], ANSWERS[:2])
    assert supervised_runs(tokenizer, ids, labels) == [a + "<|im_end|>" + tail for a in ANSWERS[:2]]
    generation = prompt.generation_prompt(QUESTIONS[:2], ANSWERS[:1])
    assert ids[:len(generation)] == generation


def test_a_template_that_writes_todays_date_is_named_unless_the_date_is_given(tokenizers, caplog):
    chat_prompt(tokenizers, "llama3.2")
    assert "today's date" not in caplog.text
    chat_prompt(tokenizers, "llama3.2", chat_template_kwargs={})
    assert "writes today's date into every prompt" in caplog.text and "date_string" in caplog.text


TOOLS_TEMPLATE = (  # ChatML turns, then a loop over `tools`, which apply_chat_template passes as None
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}\n"
    "{%- for tool in tools %}{{- tool.name }}{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_fails_inside_jinja_ends_train_py_in_one_line_naming_the_folder_and_the_line(tmp_path):
    from run_utils import run_train, tiny_config, tracebacks, write_yaml

    folder = train_family_tokenizer("qwen2.5", TINY_CORPUS, tmp_path / "tools_tokenizer", TOOLS_TEMPLATE,
                                    vocab_size=400)
    cfg = tiny_config(tmp_path / "out", tmp_path / "demo", stage=0, micro=4, sizes=(16, 8, 8))  # the build makes it
    cfg["model"]["tokenizer"] = str(folder)
    proc = run_train(write_yaml(tmp_path / "tools.yaml", cfg), nproc=0, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lavis_ds:")]
    assert proc.returncode == 2 and not tracebacks(proc.stdout + proc.stderr), proc.stderr[-3000:]
    assert len(errors) == 1 and str(folder) in errors[0], proc.stderr[-3000:]
    assert "fails at its line 2 ('{%- for tool in tools %}{{- tool.name }}{%- endfor %}'): TypeError: " \
           "'NoneType' object is not iterable" in errors[0]
