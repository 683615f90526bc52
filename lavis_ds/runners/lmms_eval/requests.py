"""lmms-eval's requests as lavis_ds batches: the prompt with lavis_ds's image markers, the processed images or video
frames, the generation settings, and where a generated answer stops.

No lmms-eval import here: a request arrives as plain values (its context, its visuals, its settings).

The prompt. A task's context is a user turn; the model's own chat template (``ChatPrompt``) wraps it, with the
model's system prompt, as training did. Where the context says where an image goes, it says so with lmms-eval's
(and LLaVA's) ``<image>`` (or ``<video>``), followed by a newline: each becomes lavis_ds's image prefix
``<Img><ImageHere></Img>`` and a space, so ``<image>\\nquestion`` is the training instruction
``<Img><ImageHere></Img> question`` (which a ``--format hf`` export's chat template writes for the same string). A
context without markers gets one ``<Img><ImageHere></Img>`` per image in front (lavis_ds's single-image format;
``lavis-ds generate`` does the same). A video is one marker whose frames
``expand_video_marker`` repeats, as a video record is in training.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from PIL import Image

from lavis_ds.common.errors import InputError
from lavis_ds.datasets.instruction import (InstructionDataset, expand_video_marker, process_text,
                                           visual_fields)
from lavis_ds.datasets.records import IMAGE_HERE, IMAGE_PLACEHOLDER
from lavis_ds.datasets.video import read_frames
from lavis_ds.processors.qwen_vl import GRID_KEY

# Where lmms-eval's (and LLaVA's) contexts put an image or a video, with the newline LLaVA writes after it
LMMS_MARKER = re.compile(r"<(?:image|video)>\n?")
# lmms-eval's generation keys that lavis_ds's generate takes under the same name (others are refused: a setting that
# is silently dropped gives numbers nobody can reproduce)
GENERATE_KEYS = ("max_new_tokens", "num_beams", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty")
IGNORED_KEYS = ("until", "image_aspect_ratio", "use_cache")  # handled here, or without meaning for lavis_ds


@dataclass
class Request:
    """One lmms-eval request as values: ``context`` (the user turn), ``visuals`` (PIL images, or one video path),
    ``continuation`` (log-likelihood requests) or ``settings`` (generation requests), ``where`` (task and doc id,
    for messages)."""

    context: str
    visuals: list[Any] = field(default_factory=list)
    continuation: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def instruction_of(context: str, num_visuals: int, video: bool) -> str:
    """The lavis_ds instruction for a task's ``context`` shown with ``num_visuals`` images (or one video)."""
    text = LMMS_MARKER.sub(IMAGE_PLACEHOLDER + " ", context)
    wanted = 1 if video else num_visuals
    if IMAGE_HERE not in text and wanted:
        return " ".join([IMAGE_PLACEHOLDER] * wanted + [text.lstrip()])
    return text


def load_visuals(request: Request, max_frames: int) -> tuple[list[Image.Image], bool]:
    """``(images or video frames, is_video)`` of a request: PIL images as they are; a path (lmms-eval's videos) is
    read as a video, ``max_frames`` frames sampled uniformly, as a video record is in training."""
    images = [v for v in request.visuals if isinstance(v, Image.Image)]
    paths = [v for v in request.visuals if isinstance(v, (str, Path))]
    if paths and (images or len(paths) > 1):
        raise InputError(f"{request.where}: {len(paths)} video(s) and {len(images)} image(s) in one request; lavis_ds "
                         "takes one video, or images, per request")
    if paths:
        return read_frames(Path(paths[0]), max_frames, request.where), True
    if len(images) != len(request.visuals):
        kinds = sorted({type(v).__name__ for v in request.visuals})
        raise InputError(f"{request.where}: visuals of type {', '.join(kinds)}; lavis_ds takes PIL images or a video "
                         "file path (what a task's doc_to_visual returns)")
    return [image.convert("RGB") for image in images], False


def batch_of(requests: Sequence[Request], image_processor: Callable, text_processor: Callable | None,
             max_frames: int) -> dict[str, Any]:
    """One lavis_ds batch of ``requests``: each request's instruction (its continuation as the answer, for
    log-likelihoods) and its images, processed as the model's evaluation processes them."""
    items = []
    for index, request in enumerate(requests):
        visuals, video = load_visuals(request, max_frames)
        instruction = instruction_of(request.context, len(visuals), video)
        if text_processor is not None:
            instruction = process_text(instruction, text_processor)
        fields = visual_fields(image_processor, visuals, video)
        num_images = len(fields[GRID_KEY]) if GRID_KEY in fields else len(visuals)
        if video:
            [instruction] = expand_video_marker([instruction], num_images)
        answer = [] if request.continuation is None else [answer_of(request.continuation)]
        items.append({**fields, "num_images": num_images, "instruction": [instruction], "output": answer,
                      "references": answer, "system": None, "where": request.where, "index": index})
    return InstructionDataset.collater(items)


def answer_of(continuation: str) -> str:
    """A continuation as the assistant's answer: lmms-eval puts the word boundary (a space) in front of it; a chat
    model's answer starts a turn of its own, where training never had that space."""
    return continuation.strip()


def generate_kwargs(settings: dict[str, Any], defaults: dict[str, Any], where: str) -> dict[str, Any]:
    """lavis_ds ``generate`` keyword arguments for a request's generation settings over the model's ``defaults``.
    lmms-eval's ``temperature: 0`` means greedy; other keys are refused in one line."""
    unknown = sorted(set(settings) - set(GENERATE_KEYS) - set(IGNORED_KEYS))
    if unknown:
        raise InputError(f"{where}: generation_kwargs {', '.join(unknown)} are not settings lavis_ds's generate "
                         f"takes (it takes {', '.join(GENERATE_KEYS)}, and until)")
    kwargs = {**defaults, **{k: v for k, v in settings.items() if k in GENERATE_KEYS and v is not None}}
    if not kwargs.get("temperature"):  # 0 (lmms-eval's greedy) or left out
        kwargs.pop("temperature", None)
        kwargs["do_sample"] = False
    elif "do_sample" not in settings:
        kwargs["do_sample"] = True  # lmms-eval samples whenever a temperature above 0 is asked for
    if not kwargs.get("do_sample"):
        for key in ("temperature", "top_p", "top_k"):  # transformers warns about sampling settings without sampling
            kwargs.pop(key, None)
    return kwargs


def stop_strings(settings: dict[str, Any], where: str) -> list[str]:
    """The request's ``until`` strings (a string or a list)."""
    until = settings.get("until") or []
    if isinstance(until, str):
        return [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
        raise InputError(f"{where}: generation_kwargs.until must be a string or a list of strings, got {until!r}")
    return list(until)


def cut_at(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first of the ``until`` strings (lmms-eval's contract for ``generate_until``)."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
