"""The non-weight half of a ``--format hf`` export: tokenizer, chat template, image processor, generation settings.

Each reproduces what lavis_ds does at generation, so that a transformers user who follows
docs/export-hf.md feeds the model the same token ids and pixels:

- the chat template writes the ChatML prompt of ``lavis_ds.models.prompt`` (system turn, an image as
  ``<Img>`` + one image token per query + ``</Img> `` in front of the text, the assistant header);
- the tokenizer is the one the model used (tokens it added included), padding on the left as
  lavis_ds's batched generation does, with ``image_token`` set so that ``Blip2Processor`` adds none;
- ``BlipImageProcessor`` does the eval image processor's square bicubic resize and normalisation;
- the generation config stops and suppresses what ``Blip2Qwen.generate`` stops at and suppresses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from lavis_ds.processors.image import CLIP_MEAN, CLIP_STD

def chat_template(system_prompt: str, image_token: str, num_query_tokens: int) -> str:
    """A Jinja chat template that renders messages as ``ChatPrompt.generation_prompt`` writes them.

    A ``{"type": "image"}`` item becomes lavis_ds's default image prefix with its placeholders
    (``<Img>`` + ``num_query_tokens`` x ``image_token`` + ``</Img> ``); text items are copied as they
    are. Without a system message the model's own ``system_prompt`` is used, as lavis_ds always does.
    Strings go in as JSON literals, which Jinja reads back unchanged (quotes, newlines, non-ASCII).
    """
    image_run = json.dumps("<Img>" + image_token * num_query_tokens + "</Img> ", ensure_ascii=False)
    system = json.dumps(system_prompt, ensure_ascii=False)
    return (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{ content }}"
        "{%- else -%}{%- for item in content -%}"
        "{%- if item['type'] == 'image' -%}{{ " + image_run + " }}"
        "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set system = render(messages[0]['content']) -%}{%- set turns = messages[1:] -%}"
        "{%- else -%}{%- set system = " + system + " -%}{%- set turns = messages -%}{%- endif -%}"
        "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}"
        "{%- for message in turns -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def image_processor(image_cfg: dict[str, Any]):
    """BLIP's image processor doing what ``blip2_image_eval`` does: RGB, Resize((s, s), bicubic), /255, normalise.

    The PIL backend, which resizes exactly as torchvision's Resize does on a PIL image (PIL's own
    bicubic). transformers' default torchvision backend resizes a uint8 tensor and can land one grey
    level off (docs/export-hf.md: load the processor with ``backend="pil"``).
    """
    from transformers.image_utils import PILImageResampling

    try:
        from transformers import BlipImageProcessorPil as processor_class  # transformers 5
    except ImportError:  # transformers 4: BlipImageProcessor is the PIL one
        from transformers import BlipImageProcessor as processor_class
    size = int(image_cfg.get("image_size", 224))
    mean, std = image_cfg.get("mean"), image_cfg.get("std")
    return processor_class(do_resize=True, size={"height": size, "width": size},
                           resample=PILImageResampling.BICUBIC, do_rescale=True, rescale_factor=1 / 255,
                           do_normalize=True, image_mean=list(CLIP_MEAN if mean is None else mean),
                           image_std=list(CLIP_STD if std is None else std), do_convert_rgb=True)


def save_processor(model: nn.Module, image_cfg: dict[str, Any], out: Path) -> None:
    """Write the tokenizer, chat template and image processor as one Blip2Processor into ``out``."""
    from transformers import AutoTokenizer, Blip2Processor

    prompt = model.prompt
    template = chat_template(prompt.system_prompt, prompt.image_token, prompt.num_image_tokens)
    model.llm_tokenizer.save_pretrained(out)
    # Reloaded with the settings as init arguments, so that save_pretrained writes them: image_token (else
    # Blip2Processor adds an "<image>" token of its own), left padding (lavis_ds pads prompts on the left so
    # that every prompt ends where its answer starts) and the template for tokenizer.apply_chat_template too.
    tokenizer = AutoTokenizer.from_pretrained(out, image_token=prompt.image_token, padding_side="left",
                                              chat_template=template)
    # num_query_tokens=None: the processor then adds no image tokens of its own (BLIP-2's OPT layout puts
    # them in front of everything); the chat template writes them where lavis_ds's prompt has them.
    processor = Blip2Processor(image_processor(image_cfg), tokenizer, num_query_tokens=None,
                               chat_template=template)
    processor.save_pretrained(out)


def generation_config(model: nn.Module):
    """Greedy decoding stopping and suppressing as ``Blip2Qwen.generate`` does.

    Blip2ForConditionalGeneration.generate hands over to ``language_model.generate``, whose own
    generation config transformers builds from ``text_config`` (``blip2_config`` puts the stop and pad
    ids there too); this one, ``model.generation_config``, also suppresses the image token and is what
    ``model.generate(..., generation_config=model.generation_config)`` uses (docs/export-hf.md).
    """
    from transformers import GenerationConfig

    from lavis_ds.apps.generation import GenerationSettings  # what lavis_ds.apps.generate answers with when not told otherwise

    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=GenerationSettings().max_new_tokens,
                            eos_token_id=model.stop_token_ids(), pad_token_id=model.pad_id,
                            # The placeholder is never a word: generating it would feed its meaningless row back in.
                            suppress_tokens=[model.prompt.image_token_id])

