"""Answering with a trained model, shared by the generate command, the terminal chat and the web page.

``generate`` runs a model on processed images and prompts as the training run ran it (the dtype and
autocast of its engine, ``as_trained``); ``eval_processors`` are the image and text processors of an
export's evaluation; ``GenerationSettings`` are the decoding settings a user can change, with their
command-line arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from PIL import Image
from torch import nn

from lavis_ds.apps.export_io import read_export_config
from lavis_ds.common.precision import as_trained, cast_dtype  # noqa: F401  (cast_dtype: importers of this module)
from lavis_ds.common.suggest import did_you_mean


def eval_processors(folder: str | Path) -> tuple[Callable, Callable | None]:
    """``(image processor, text processor or None)`` for an export folder (``image_config.eval_processors_of``)."""
    from lavis_ds.image_config import eval_processors_of

    return eval_processors_of(read_export_config(folder))


@torch.no_grad()
def generate(model: nn.Module, images: torch.Tensor, prompts: Sequence[str | Sequence[str]],
             answers: Sequence[Sequence[str]] | None = None, num_images: Sequence[int] | None = None,
             systems: Sequence[str | None] | None = None, **generate_kwargs: Any) -> list[str]:
    """Answers for a batch: ``images [N, 3, H, W]`` (processed) and one prompt per sample.

    A prompt is a string, or the turns of a conversation whose earlier answers are in
    ``answers``; the last turn is answered. ``num_images`` (default: one per sample)
    says how many of ``images`` belong to each sample, in order (0: a text-only sample;
    ``images`` may then be empty); each image's features go where its ``<ImageHere>``
    stands (one image may go unmarked). ``systems``: each sample's own system prompt (None: the model's
    ``system_prompt``), as training sent it. Keyword arguments go to the model's ``generate``
    (``max_new_tokens``, ``num_beams``, ``do_sample``, ``streamer``, ...).
    """
    batch = {"image": images, "instruction": [[p] if isinstance(p, str) else list(p) for p in prompts]}
    if answers is not None:
        batch["output"] = [list(a) for a in answers]
    if num_images is not None:
        batch["num_images"] = list(num_images)
    if systems is not None:
        batch["system"] = list(systems)
    batch, context = as_trained(model, batch)
    with context:
        return model.generate(batch, **generate_kwargs)


# ----------------------------------------------------------------------------- generation settings
@dataclass
class GenerationSettings:
    """What the terminal chat, the web page and the command line let a user change.

    Greedy decoding by default (``do_sample=False, num_beams=1``); ``num_beams > 1`` is beam
    search; ``do_sample`` samples with ``temperature``, ``top_p`` and ``top_k``.
    """

    max_new_tokens: int = 30
    do_sample: bool = False
    num_beams: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = {
            "max_new_tokens": self.max_new_tokens >= 1,
            "num_beams": self.num_beams >= 1,
            "temperature": self.temperature > 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "repetition_penalty": self.repetition_penalty > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError("; ".join(f"{name}={getattr(self, name)!r} is out of range ({RANGES[name]})"
                                       for name in bad))

    def to_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``generate``; the sampling ones only when sampling (transformers warns otherwise)."""
        kwargs = {"max_new_tokens": self.max_new_tokens, "num_beams": self.num_beams, "do_sample": self.do_sample,
                  "repetition_penalty": self.repetition_penalty}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return kwargs

    def replace(self, key: str, text: str) -> "GenerationSettings":
        """A copy with ``key`` set from the text ``text`` (``"0.7"``, ``"true"``); ``ValueError`` says what is valid."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        if key not in fields:
            hint = did_you_mean(key, fields)
            raise ValueError(f"unknown setting {key!r}{'; ' + hint if hint else ''} (settings: {', '.join(fields)})")
        kind = type(getattr(GenerationSettings(), key))
        try:
            value = _parse_bool(text) if kind is bool else kind(text)
        except ValueError:
            raise ValueError(f"{key}: {text!r} is not {'true/false' if kind is bool else f'a {kind.__name__}'}") \
                from None
        return dataclasses.replace(self, **{key: value})


RANGES = {"max_new_tokens": ">= 1", "num_beams": ">= 1", "temperature": "> 0", "top_p": "in (0, 1]",
          "top_k": ">= 0; 0 keeps all tokens", "repetition_penalty": "> 0; 1 is none"}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


def add_generation_arguments(parser: argparse.ArgumentParser, defaults: GenerationSettings) -> None:
    """``--max-new-tokens``, ``--num-beams``, ``--do-sample``, ... with ``defaults``."""
    group = parser.add_argument_group("generation settings")
    group.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    group.add_argument("--num-beams", type=int, default=defaults.num_beams, help="> 1: beam search")
    group.add_argument("--do-sample", action="store_true", default=defaults.do_sample,
                       help="sample (with --temperature, --top-p, --top-k) instead of greedy/beam search")
    group.add_argument("--temperature", type=float, default=defaults.temperature)
    group.add_argument("--top-p", type=float, default=defaults.top_p)
    group.add_argument("--top-k", type=int, default=defaults.top_k)
    group.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty)


def settings_from_args(args: argparse.Namespace) -> GenerationSettings:
    return GenerationSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationSettings)})


def open_image(path: str | Path) -> Image.Image:
    """An RGB image; ``ValueError`` naming the file if it is missing or does not decode."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"image file {path} not found")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
        raise ValueError(f"cannot read image file {path}: {type(e).__name__}: {e}") from None
