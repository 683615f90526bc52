"""Text processors: one string in, one string out."""
from __future__ import annotations

import re

from lavis_ds.common import registry as reg
from lavis_ds.processors.base import BaseProcessor

_PUNCTUATION = re.compile(r"([.!\"()*#:;~])")
_RUNS_OF_SPACE = re.compile(r"\s{2,}")


def _check_max_words(max_words: int) -> None:
    if isinstance(max_words, bool) or not isinstance(max_words, int) or max_words <= 0:
        raise ValueError(f"max_words must be a positive integer, got {max_words!r}")


def _truncate_words(text: str, max_words: int) -> str:
    words = text.split(" ")
    return " ".join(words[:max_words]) if len(words) > max_words else text


@reg.processors.register("blip_caption")
class BlipCaptionProcessor(BaseProcessor):
    """LAVIS caption cleaning: lowercase, punctuation to spaces, squeeze spaces,
    keep the first ``max_words`` words, then prepend ``prompt``."""

    def __init__(self, *, prompt: str = "", max_words: int = 50) -> None:
        _check_max_words(max_words)
        self.prompt, self.max_words = prompt, max_words

    def __call__(self, text: str) -> str:
        text = _PUNCTUATION.sub(" ", text.lower())
        text = _RUNS_OF_SPACE.sub(" ", text).rstrip("\n").strip(" ")
        return self.prompt + _truncate_words(text, self.max_words)


@reg.processors.register("base_instruction")
class BaseInstructionProcessor(BaseProcessor):
    """MiniGPT4Qwen's instruction cleaning: squeeze whitespace, keep the first
    ``max_words`` words, prepend ``prompt``; case and punctuation are kept.

    Registered so MiniGPT4Qwen YAMLs (``name: base_instruction``) keep working.
    """

    def __init__(self, *, prompt: str = "", max_words: int = 50) -> None:
        _check_max_words(max_words)
        self.prompt, self.max_words = prompt, max_words

    def __call__(self, text: str) -> str:
        text = _RUNS_OF_SPACE.sub(" ", text).rstrip("\n").strip(" ")
        return self.prompt + _truncate_words(text, self.max_words)


@reg.processors.register("plain_text")
class PlainTextProcessor(BaseProcessor):
    """Strip leading and trailing whitespace, nothing else."""

    def __init__(self) -> None:
        pass

    def __call__(self, text: str) -> str:
        return text.strip()
