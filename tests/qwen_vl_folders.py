"""Tiny published Qwen2-VL / Qwen2.5-VL folders as transformers writes them: the model (save_pretrained), a Qwen2
tokenizer with the vision tokens and Qwen2-VL's chat template, and the processor (image and video processors)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                          Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

from lavis_ds.models.tokenizer import SPECIAL_TOKENS, train_chatml_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
# Qwen2-VL-*-Instruct's chat template (tokenizer_config.json / chat_template.json of the published folders).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 48)
VISION = {"qwen2_vl": dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=64),
          "qwen2_5_vl": dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                             fullatt_block_indexes=[1, 3], tokens_per_second=2)}
CLASSES = {"qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor),
           "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor)}


def qwen_tokenizer(corpus: list[str], folder: Path, template: str | None = QWEN2_VL_TEMPLATE):
    """A tiny Qwen2 tokenizer with Qwen2-VL's special tokens (and its chat template)."""
    train_chatml_tokenizer(corpus, folder, vocab_size=400, special_tokens=(*SPECIAL_TOKENS, *VISION_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def published_folder(kind: str, corpus: list[str], folder: Path, layout: str = "hub"):
    """A random tiny ``kind`` model saved with its tokenizer and processor; ``layout`` "modules": its weights
    renamed as transformers 5 names the modules (``model.visual.*``, ``model.language_model.*``)."""
    from safetensors.torch import load_file, save_file

    config_class, model_class, processor_class = CLASSES[kind]
    tokenizer = qwen_tokenizer(corpus, folder)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = model_class(config_class(vision_config=VISION[kind], text_config=text, tie_word_embeddings=False,
                                     **ids)).eval()
    with torch.no_grad():  # norms and biases random too: a key mapped to the wrong place shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    processor = processor_class(image_processor=Qwen2VLImageProcessor(**PIXELS), tokenizer=tokenizer,
                                video_processor=Qwen2VLVideoProcessor(**PIXELS), chat_template=QWEN2_VL_TEMPLATE)
    processor.save_pretrained(folder)
    if layout == "modules":
        state = load_file(folder / "model.safetensors")
        renamed = {("model." + k if k.startswith("visual.") else
                    "model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
                   for k, v in state.items()}
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    return model, processor
