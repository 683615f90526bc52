"""Tiny stand-ins of other LLM families: a tokenizer with the family's special tokens and its published chat template
(tests/fixtures/chat_templates, sources in SOURCES.md), and a randomly initialised model folder of its architecture."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import TINY_CORPUS
from lavis_ds.models.tokenizer import train_family_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
LLAMA_MODEL = {"image_token": "<|reserved_special_token_0|>", "chat_template_kwargs": {"date_string": "26 Jul 2024"}}


@dataclass(frozen=True)
class Family:
    tokens: str  # lavis_ds.models.tokenizer.FAMILIES key: the special tokens and their roles
    template: str  # file under fixtures/chat_templates
    model_type: str  # transformers architecture
    end_of_turn: str  # the token that closes an assistant answer
    model: dict = field(default_factory=dict)  # model: keys the family needs (image token, system prompt, variables)

    def chat_template(self) -> str:
        return (TEMPLATES / self.template).read_text()


FAMILIES = {
    "qwen2.5": Family("qwen2.5", "qwen2.5-7b-instruct.jinja", "qwen2", "<|im_end|>"),
    "qwen3": Family("qwen3", "qwen3-0.6b.jinja", "qwen3", "<|im_end|>",
                    {"chat_template_kwargs": {"enable_thinking": False}}),
    "qwen3.5": Family("qwen3.5", "qwen3.5-35b-a3b.jinja", "qwen3_5_text", "<|im_end|>",
                      {"chat_template_kwargs": {"enable_thinking": False}}),
    "llama3.2": Family("llama3", "llama-3.2-3b-instruct.jinja", "llama", "<|eot_id|>", LLAMA_MODEL),
    "llama3.3": Family("llama3", "llama-3.3-70b-instruct.jinja", "llama", "<|eot_id|>", LLAMA_MODEL),
    # Gemma's template refuses a system message.
    "gemma2": Family("gemma", "gemma-2-2b-it.jinja", "gemma2", "<end_of_turn>", {"system_prompt": None}),
}


def tokenizer_dir(path: Path, name: str, texts: list[str] | None = None) -> Path:
    """A tiny tokenizer of family ``name`` with its published chat template."""
    family = FAMILIES[name]
    return train_family_tokenizer(family.tokens, list(texts or TINY_CORPUS), path, family.chat_template(),
                                  vocab_size=400)


def model_folder(path: Path, name: str, texts: list[str] | None = None) -> Path:
    """A tiny model folder of family ``name`` as save_pretrained writes it, with its tokenizer beside."""
    tokenizer_dir(path, name, texts)
    size = len(AutoTokenizer.from_pretrained(path))
    torch.manual_seed(0)
    config = AutoConfig.for_model(FAMILIES[name].model_type, vocab_size=size, **TINY_LLM)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path
