"""The conversation both chats drive: :class:`ChatSession`, one multi-turn conversation about images with one
exported model, streamed answer by answer.

The terminal (:mod:`lavis_ds.apps.chat`) and the web page (:mod:`lavis_ds.apps.webui`) are front ends around it.
What it sends the model (the ChatML prompt with its system turn, where each image's marker stands, which turns
are left out when the conversation outgrows the context) is described in :mod:`lavis_ds.apps.chat`'s docstring,
the text ``lavis-ds chat --help`` prints.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from PIL import Image
from torch import nn
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer, set_seed

from lavis_ds.datasets.instruction import process_text
from lavis_ds.datasets.records import IMAGE_HERE, IMAGE_PLACEHOLDER
from lavis_ds.apps.export import load_exported
from lavis_ds.apps.generation import GenerationSettings, eval_processors, generate, open_image

CHAT_DEFAULTS = GenerationSettings(max_new_tokens=256)


@dataclass
class Turn:
    """One question, the images shown with it, and the model's answer."""

    question: str
    images: list[int]  # positions in ChatSession.images of the images shown in front of the question
    answer: str


@dataclass
class LoadedImage:
    name: str
    tensor: torch.Tensor  # processed by the export's eval image processor


class Interrupted(Exception):
    """Generation was stopped by the user; the turn is not kept."""


class _StopFlag(StoppingCriteria):
    """Ends generation once ``event`` is set (Ctrl-C in the terminal, a new question on the page)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


@dataclass
class ChatSession:
    """A multi-turn conversation about images with one exported model.

    Args:
        model: A loaded export (:func:`lavis_ds.apps.export.load_exported`).
        image_processor, text_processor: The export's eval processors
            (:func:`lavis_ds.apps.generation.eval_processors`); ``text_processor`` may be None.
        settings: Generation settings; change them with :meth:`set`.
        seed: Set before every answer, so the same conversation gives the same answers
            (also when sampling).
        system: The conversation's system prompt, sent as training sent a record's own system turn
            (``model.record_system_prompt``); None sends the model's ``system_prompt``.
    """

    model: nn.Module
    image_processor: Callable[[Image.Image], torch.Tensor]
    text_processor: Callable[[str], str] | None = None
    settings: GenerationSettings = field(default_factory=lambda: CHAT_DEFAULTS)
    seed: int = 42
    system: str | None = None  # the conversation's own system prompt, as a record's system turn; None: the model's
    turns: list[Turn] = field(default_factory=list)
    images: list[LoadedImage] = field(default_factory=list)  # every image, in the order loaded
    pending: list[int] = field(default_factory=list)  # images not shown yet: they go with the next question
    # The answer being generated stops when its event is set. One per answer: an abandoned answer
    # (a closed page) may be cleaned up later, and must not stop the next one then.
    stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def from_export(cls, folder: str | Path, device: str = "cpu", dtype: str = "auto", **kwargs: Any) -> "ChatSession":
        model = load_exported(folder, device=device, dtype=dtype)
        image_processor, text_processor = eval_processors(folder)
        return cls(model, image_processor, text_processor, **kwargs)

    # ------------------------------------------------------------------ images and history
    def add_image(self, image: Image.Image | str | Path, name: str | None = None) -> str:
        """Load an image into the conversation; it is shown with the next question. Returns its name."""
        if not isinstance(image, Image.Image):
            name = name or str(image)
            image = open_image(image)
        name = name or f"image {len(self.images) + 1}"
        self.images.append(LoadedImage(name, self.image_processor(image.convert("RGB"))))
        self.pending.append(len(self.images) - 1)
        return name

    def clear_history(self) -> int:
        """Forget the questions and answers; the images stay and are shown again with the next question."""
        cleared = len(self.turns)
        self.turns.clear()
        self.pending = list(range(len(self.images)))
        return cleared

    def reset(self) -> None:
        """Forget everything: history and images."""
        self.turns.clear()
        self.images.clear()
        self.pending.clear()

    def set(self, key: str, value: str) -> None:
        """Change one generation setting from text (``set("temperature", "0.7")``); ``ValueError`` if invalid."""
        self.settings = self.settings.replace(key, value)

    # ------------------------------------------------------------------ answering
    def ask(self, question: str) -> Iterator[str]:
        """Answer ``question``: an iterator of the text as it is generated; the turn is kept when it ends.

        Raises ``ValueError`` at once for a question that cannot be asked (an image
        marker typed by hand, a conversation too long for the model);
        the iterator raises :class:`Interrupted` after :meth:`interrupt`.
        """
        question = question.strip()
        if not question:
            raise ValueError("the question is empty")
        if IMAGE_HERE in question or "<Img>" in question:
            raise ValueError(f"{IMAGE_HERE!r} and <Img> are the image markers; load images with :img <path> "
                             "(or the upload box) instead of typing them")
        turns, pending = self._fitting_turns(question)
        self.stop = threading.Event()  # from here on, interrupt() stops this answer
        return self._answer(question, turns, pending, self.stop)

    def answer(self, question: str) -> str:
        """:meth:`ask` without streaming: the whole answer."""
        for _ in self.ask(question):
            pass
        return self.turns[-1].answer

    def _answer(self, question: str, turns: list[Turn], pending: list[int], stop: threading.Event) -> Iterator[str]:
        instructions = [self._instruction(t.question, t.images) for t in turns]
        instructions.append(self._instruction(question, pending))
        shown = [i for t in turns for i in t.images] + pending
        # No image yet: a text-only turn, an empty image batch (the model then runs no vision tower).
        images = torch.stack([self.images[i].tensor for i in shown]) if shown else torch.zeros((0, 3, 1, 1))
        kwargs = self.settings.to_kwargs()
        kwargs["stopping_criteria"] = StoppingCriteriaList([_StopFlag(stop)])
        set_seed(self.seed)  # before every answer, as cli_demo.py does
        answer = yield from self._stream(images, instructions, [t.answer for t in turns], len(shown), kwargs, stop)
        if stop.is_set():
            raise Interrupted("generation interrupted; the question was not kept")
        self.turns[:] = turns
        self.turns.append(Turn(question, pending, answer))
        self.pending = []

    def interrupt(self) -> None:
        """Stop the answer being generated (from another thread, or a Ctrl-C handler)."""
        self.stop.set()

    def _instruction(self, question: str, image_indices: list[int]) -> str:
        text = process_text(question, self.text_processor) if self.text_processor else question
        return " ".join([IMAGE_PLACEHOLDER] * len(image_indices) + [text])

    def _fitting_turns(self, question: str) -> tuple[list[Turn], list[int]]:
        """The history turns that fit the context with the new question, and the images to show with it.

        The oldest turns are dropped first; their images are moved to the oldest turn kept
        (or to the new question), so the model still sees every image.
        """
        limit = getattr(self.model.llm.config, "max_position_embeddings", None)
        turns = [dataclasses.replace(t, images=list(t.images)) for t in self.turns]
        pending = list(self.pending)
        while True:
            instructions = [self._instruction(t.question, t.images) for t in turns]
            instructions.append(self._instruction(question, pending))
            shown = [i for t in turns for i in t.images] + pending
            num_images = len(shown)
            # Each image's own count (a Qwen-VL model's depends on the image's size).
            layout = self.model.image_path.layout
            counts = layout.counts({"image": torch.stack([self.images[i].tensor for i in shown])}) if shown else []
            length = len(self.model.llm.prompt.generation_prompt(instructions, [t.answer for t in turns], num_images,
                                                             image_tokens=counts, system=self.system))
            if limit is None or length + self.settings.max_new_tokens <= limit:
                return turns, pending
            if not turns:
                raise ValueError(f"the question with its {num_images} image(s) takes {length} tokens; with "
                                 f"max_new_tokens={self.settings.max_new_tokens} that exceeds the model's context "
                                 f"of {limit} tokens (lower max_new_tokens, or :reset and load fewer images)")
            dropped = turns.pop(0)
            if turns:
                turns[0].images[:0] = dropped.images
            else:
                pending[:0] = dropped.images

    def _stream(self, images: torch.Tensor, instructions: list[str], answers: list[str], num_images: int,
                kwargs: dict[str, Any], stop: threading.Event) -> Iterator[str]:
        """Yield the answer's text as generated (a generator returning the whole answer)."""
        call = dict(images=images, prompts=[instructions], answers=[answers], num_images=[num_images],
                    systems=[self.system])
        if self.settings.num_beams > 1:  # transformers' streamers do not support beam search: all at once
            answer = generate(self.model, **call, **kwargs)[0]
            yield answer
            return answer
        streamer = TextIteratorStreamer(self.model.llm.tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                result["answer"] = generate(self.model, **call, streamer=streamer, **kwargs)[0]
            except BaseException as e:  # handed to the caller below; end() unblocks its loop
                result["error"] = e
                streamer.end()

        # generate() enters no_grad and autocast itself: both are per thread.
        worker = threading.Thread(target=work, name="lavis_ds-generate", daemon=True)
        worker.start()
        try:
            for piece in streamer:
                if piece:
                    yield piece
        finally:
            if worker.is_alive() and sys.exc_info()[0] is not None:
                stop.set()  # the consumer went away (Ctrl-C, closed page): let the thread finish soon
            worker.join()
        if "error" in result:
            raise result["error"]
        return result["answer"]
