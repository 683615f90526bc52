"""The non-weight half of a ``--format hf`` export: tokenizer, chat template, image processor, generation settings.

Each reproduces what lavis_ds does at generation, so that a transformers user who follows
docs/export-hf.md feeds the model the same token ids and pixels:

- the chat template writes the ChatML prompt of ``lavis_ds.models.prompt`` (system turn, an image as
  ``<Img>`` + its image tokens + ``</Img> `` in front of the text, the assistant header), as many image tokens
  per image as the family's processor leaves to the template (``ProcessorExport.template_image_tokens``): BLIP-2 and
  InstructBLIP one per query; LLaVA one per image, which ``LlavaProcessor`` expands into the tower's tokens; where
  the run's ``chat_template_kwargs`` shaped the prompt (Qwen3's ``enable_thinking: false``), the LLM's own template
  renders it, behind a prelude that writes the messages as training did and defaults to those variables;
- the tokenizer is the one the model used (tokens it added included), padding on the left as
  lavis_ds's batched generation does, with ``image_token`` set so that the processor adds none of its own;
- the image processor does the eval processing, as the family builds it (``ProcessorExport.image_processor``): BLIP's
  square resize (BLIP-2, InstructBLIP), CLIP's shortest-edge resize and centre crop, SigLIP's square resize,
  LLaVA-1.5's pad-to-square (``LlavaImageProcessor`` with ``do_pad``), each with the tower's size, mean and std;
- the processor is the family's (``ProcessorExport.processor``); InstructBLIP's carries ``qformer_tokenizer/``, the
  connector's BERT tokenizer, truncating on the left at its ``max_instruction_len`` as lavis_ds does and reading
  the image's user turn out of a whole prompt (``models.hf.blip_instruction``), so that
  ``processor(images=..., text=...)`` prepares lavis_ds's ids; the family finishes the saved folder
  (``ProcessorExport.finish_processor_folder``);
- the generation config stops and suppresses what ``VisionLLM.generate`` stops at and suppresses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from lavis_ds.models.chat_template import template_text
from lavis_ds.models.hf.family import HfFamily, exporting_family
from lavis_ds.models.template_defaults import CarriedVariables, carried_variables, jinja_literal


def chat_template(system_prompt: str, image_token: str, num_query_tokens: int, record_system: str = "use",
                  image_run: str | None = None, video_run: str | None = None) -> str:
    """A Jinja chat template that renders messages as ``ChatPrompt.generation_prompt`` writes them.

    A ``{"type": "image"}`` item, and in a string each ``<image>`` with the newline after it (LLaVA's convention,
    which lmms-eval's ``llava_hf`` writes in front of a task's question), becomes lavis_ds's default image prefix with
    its placeholders (``<Img>`` + ``num_query_tokens`` x ``image_token`` + ``</Img> ``; LLaVA's processor expands
    one token per image itself, so its template writes 1); text items are copied as they are. A first system message is
    what a record's own system turn is in training (``record_system``, the model's ``record_system_prompt``):
    ``use`` sends it instead of the model's ``system_prompt``, ``ignore`` sends the model's, ``fold`` sends the
    model's and puts its text and a blank line in front of the first user message. Without one the model's own
    ``system_prompt`` is used, as lavis_ds always does.
    Strings go in as JSON literals, which Jinja reads back unchanged (quotes, newlines, non-ASCII).
    ``image_run``: what an image item writes instead, for a family whose prompt spans images otherwise (Qwen-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``, ``ProcessorExport.template_image_run``).
    ``video_run``: what a ``{"type": "video"}`` item writes, for a family whose processor takes videos (Qwen-VL's
    ``<|vision_start|><|video_pad|><|vision_end|>``, ``ProcessorExport.template_video_run``); None: a video item
    writes nothing.
    """
    system = json.dumps(system_prompt, ensure_ascii=False)
    own = {"use": "{%- set system = lavis_ds_content(messages[0]['content']) -%}",
           "ignore": "",
           "fold": "{%- set fold = lavis_ds_content(messages[0]['content']) + '\\n\\n' -%}"}[record_system]
    return (
        content_macro(image_token, num_query_tokens, image_run, video_run) +
        "{%- set system = " + system + " -%}{%- set fold = '' -%}{%- set turns = messages -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        + own + "{%- set turns = messages[1:] -%}"
        "{%- endif -%}"
        "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}"
        "{%- for message in turns -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + (fold if loop.first else '')"
        " + lavis_ds_content(message['content']) + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def published_with_defaults(published: str, carried: CarriedVariables, system_prompt: str | None,
                            content: str, record_system: str = "use") -> str:
    """The tokenizer's own chat template ``published`` (what training rendered prompts with) behind a prelude that
    hands it the messages as training did and the run's template variables as defaults.

    The prelude turns each message's content into the text training put in its turn (``content``, the
    :func:`content_macro`), sends the model's ``system_prompt`` where the messages start without a system message, a
    first system message as ``record_system`` says (as :func:`chat_template`), then sets ``carried``'s variables
    where the caller passes none (``enable_thinking: false`` for Qwen3): the default call renders
    ``ChatPrompt.generation_prompt``, and a caller may still pass the variables."""
    own = {"use": "{%- set lavis_ds.system = lavis_ds_content(messages[0]['content']) -%}",
           "ignore": "",
           "fold": "{%- set lavis_ds.fold = lavis_ds_content(messages[0]['content']) + '\\n\\n' -%}"}[record_system]
    return (
        content +
        "{%- set lavis_ds = namespace(system=" + jinja_literal(system_prompt) + ", fold='', turns=messages, "
        "messages=[]) -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}" + own +
        "{%- set lavis_ds.turns = messages[1:] -%}{%- endif -%}"
        "{%- if lavis_ds.system is not none -%}"
        "{%- set lavis_ds.messages = [{'role': 'system', 'content': lavis_ds.system}] -%}{%- endif -%}"
        "{%- for message in lavis_ds.turns -%}"
        "{%- set lavis_ds.messages = lavis_ds.messages + [{'role': message['role'], 'content': "
        "(lavis_ds.fold if loop.first else '') + lavis_ds_content(message['content'])}] -%}"
        "{%- endfor -%}"
        "{%- set messages = lavis_ds.messages -%}"
        + carried.prelude() + published
    )


def content_macro(image_token: str, num_query_tokens: int, image_run: str | None = None,
                  video_run: str | None = None) -> str:
    """The Jinja macro ``lavis_ds_content(content)``: a message's content as the text training put in its turn (image
    and video items, and LLaVA's ``<image>`` in a string, as their placeholder runs; see :func:`chat_template`)."""
    image_run = json.dumps(image_run if image_run is not None else "<Img>" + image_token * num_query_tokens
                           + "</Img> ", ensure_ascii=False)
    video = "" if video_run is None else \
        "{%- elif item['type'] == 'video' -%}{{ " + json.dumps(video_run, ensure_ascii=False) + " }}"
    return (
        "{%- macro lavis_ds_content(content) -%}"
        "{%- if content is string -%}"
        # LLaVA's convention in a string: "<image>" (and the newline after it) stands for an image
        "{%- set parts = content.split('<image>') -%}{{ parts[0] }}"
        "{%- for part in parts[1:] -%}{{ " + image_run + " }}{{ part[1:] if part.startswith('\\n') else part }}"
        "{%- endfor -%}"
        "{%- else -%}{%- for item in content -%}"
        "{%- if item['type'] == 'image' -%}{{ " + image_run + " }}" + video +
        "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
    )


def image_processing_of(image_cfg: dict[str, Any]):
    """The eval image processor section as a tower's ``ImageProcessing`` (resize, mean/std, padding), else None.

    Every registered image processor carries one (``processing``): ``blip2_image_eval`` a square bicubic resize,
    ``tower_image_eval`` its tower's processing; one that augments (random crops, flips) is served by none."""
    from lavis_ds.datasets.processor_sections import build_processor
    from lavis_ds.image_config import section_processing
    from lavis_ds.processors.qwen_vl import QwenVLProcessing

    processing = section_processing(image_cfg, served=True)
    if processing is not None:
        return processing
    try:  # a processor of images at their own sizes (qwen_vl_image) carries its own kind of processing
        own = getattr(build_processor(image_cfg), "processing", None)
    except (KeyError, ValueError, TypeError):
        return None
    return own if isinstance(own, QwenVLProcessing) else None


def default_image_cfg(model: nn.Module) -> dict[str, Any]:
    """The eval image processor section of a model whose run names none: what lavis_ds generates with then
    (``lavis_ds.apps.generation.eval_processors``), the tower's processing for llava and instructblip."""
    from lavis_ds.image_config import model_eval_processor

    processing = getattr(getattr(model, "vision_tower", None), "processing", None)
    return model_eval_processor(type(model), processing, model.image_path.layout.image_size)


def image_processor(processing, family: HfFamily | str):
    """The transformers image processor (PIL backend) of ``family`` (a registered family or its name) doing what
    ``processing`` (an ``ImageProcessing``) does: ``BlipImageProcessor``'s square resize, or LLaVA's CLIP / SigLIP /
    ``LlavaImageProcessor`` (``ProcessorExport.image_processor``)."""
    return _family(family).processors.image_processor(processing)


def save_processor(model: nn.Module, image_cfg: dict[str, Any] | None, out: Path,
                   family: HfFamily | str | None = None) -> CarriedVariables:
    """Write the tokenizer, chat template and image processor as the family's processor into ``out``
    (``Blip2Processor``, ``InstructBlipProcessor`` with ``qformer_tokenizer/``, ``LlavaProcessor``, ...).

    ``image_cfg``: the eval image processor section (None: the model's own, ``default_image_cfg``).
    ``family``: the family the model exports to (None: the one that holds it).
    Returns the run's template variables the chat template carries as defaults, and notes on those it cannot."""
    from transformers import AutoTokenizer

    family = _family(family) if family is not None else exporting_family(model)
    if family is None:
        raise ValueError(f"{type(model).__name__}: no transformers class holds it (check_expressible says why)")
    prompt = model.llm.prompt
    processing = image_processing_of(image_cfg or default_image_cfg(model))
    export = family.processors
    images = export.image_processor(processing)
    carried = run_variables(prompt)
    template = export.export_chat_template(model) or _lavis_ds_template(model, prompt, export, carried)
    model.llm.tokenizer.save_pretrained(out)
    # Reloaded with the settings as init arguments, so that save_pretrained writes them: image_token (else the
    # processor adds an "<image>" token of its own), left padding (lavis_ds pads prompts on the left so that every
    # prompt ends where its answer starts) and the template for tokenizer.apply_chat_template too.
    tokenizer = AutoTokenizer.from_pretrained(out, image_token=prompt.image_token, padding_side="left",
                                              chat_template=template)
    export.processor(model, images, tokenizer, template).save_pretrained(out)
    export.finish_processor_folder(model, out)
    export.check_exported_processor(model, out, processing)
    return carried


def run_variables(prompt) -> CarriedVariables:
    """The run's template variables (``ChatPrompt.template_variables``) its tokenizer's own template carries."""
    published = template_text(prompt.tokenizer)
    if published is None:  # ChatML written by lavis_ds: no variable shaped the prompt
        return CarriedVariables()
    return carried_variables(published, prompt.template_variables, prompt.tokenizer.special_tokens_map)


def _lavis_ds_template(model: nn.Module, prompt, export, carried: CarriedVariables) -> str:
    """lavis_ds's ChatML template of the model's prompt; where the run's template variables shaped the prompt
    (Qwen3's ``enable_thinking: false`` writes an empty think block after the assistant header), the tokenizer's own
    template behind lavis_ds's message prelude, with them as defaults (:func:`published_with_defaults`)."""
    image_tokens, image_run, video_run = (export.template_image_tokens(model), export.template_image_run(model),
                                          export.template_video_run(model))
    if not (carried.carried or carried.notes):
        return chat_template(prompt.system_prompt, prompt.image_token, image_tokens, prompt.record_system_prompt,
                             image_run, video_run)
    content = content_macro(prompt.image_token, image_tokens, image_run, video_run)
    return published_with_defaults(template_text(prompt.tokenizer), carried, prompt.system_prompt, content,
                                   prompt.record_system_prompt)


def _family(family: HfFamily | str) -> HfFamily:
    from lavis_ds.common.registry import hf_families

    return hf_families.get(family) if isinstance(family, str) else family


def generation_config(model: nn.Module, max_new_tokens: int | None = None):
    """Greedy decoding stopping and suppressing as ``VisionLLM.generate`` does, ``max_new_tokens`` new tokens at
    most (None: the default of the model's ``generate``).

    Blip2ForConditionalGeneration.generate hands over to ``language_model.generate``, whose own
    generation config transformers builds from ``text_config`` (``blip2_config`` puts the stop and pad
    ids there too); this one, ``model.generation_config``, also suppresses the image token and is what
    ``model.generate(..., generation_config=model.generation_config)`` uses (docs/export-hf.md).
    """
    import inspect

    from transformers import GenerationConfig

    if max_new_tokens is None:
        max_new_tokens = inspect.signature(model.generate).parameters["max_new_tokens"].default
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                            eos_token_id=model.llm.stop_token_ids(), pad_token_id=model.llm.pad_id,
                            # The placeholder is never a word: generating it would feed its meaningless row back in.
                            suppress_tokens=model.llm.prompt.placeholder_ids)

