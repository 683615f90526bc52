"""How long a training sample is, without loading it: what length-grouped and token-budget batching plan by.

LLaVA's ``group_by_modality_length`` sorts by the words of a conversation, text-only samples apart
from image ones; ``approximate_length`` does the same: a sample's length is the number of words of its
turns, and a text-only sample (no image) counts as negative so that it groups with its own kind.

A token budget (``run.batch_unit: tokens``) needs tokens, not words. Tokenizing every sample of a 665k
mix up front would cost minutes on every process; reading the words of a record costs microseconds.
So ``TokenEstimate`` predicts a sample's text tokens from its words, characters, turns and images, fitted once by
least squares on the exact token counts of a few hundred samples spread over the training set (the model
tokenizes their text, as its ``prepare_batch`` does in training; no image is read), and adds its image tokens
exactly: each image's count from the model's own ``tokens_for_image`` of the size the dataset gives it
(``image_sizes``), the count its prompt reserves in training. Where the dataset cannot tell the sizes without
reading the images, the fitted per-image term stands for them. The estimate only
decides which samples share a micro-batch: packing then lays out the exact tokens, so a wrong estimate
costs padding, never a sample or a token.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from lavis_ds.common.errors import ImageSpanCut, InputError
from lavis_ds.common.seeding import SeededDataset
from lavis_ds.datasets.mixing import MixedDataset

CALIBRATION_SAMPLES = 256  # exact counts the estimate is fitted on: a few seconds of tokenizing at most


def leaf_of(dataset: Dataset, index: int, epoch: int, setting: str) -> tuple[Dataset, int]:
    """(the dataset holding sample ``index`` of ``epoch``, its record index there), through the wrappers;
    InputError naming ``setting`` if that dataset has no ``records`` to read lengths from."""
    if isinstance(dataset, SeededDataset):
        return leaf_of(dataset.dataset, index, epoch, setting)
    if isinstance(dataset, MixedDataset):
        part, record = dataset.locate(index, epoch)
        return leaf_of(dataset.parts[part], record, epoch, setting)
    if isinstance(dataset, ConcatDataset):
        part = bisect.bisect_right(dataset.cumulative_sizes, index)
        local = index - (dataset.cumulative_sizes[part - 1] if part else 0)
        return leaf_of(dataset.datasets[part], local, epoch, setting)
    if getattr(dataset, "records", None) is None:
        raise InputError(f"{setting}: {type(dataset).__name__} cannot tell how long its samples are (it has no "
                         f"`records` of instruction/output turns); turn {setting} off")
    return dataset, index


def approximate_length(dataset: Dataset, index: int, epoch: int) -> int:
    """Words of sample ``index`` of ``epoch`` (negative: a sample without an image), through the wrappers."""
    words, _, _, images = shape_of(*leaf_of(dataset, index, epoch, "run.length_grouped"))
    return words if images else -words


def shape_of(leaf: Dataset, local: int) -> tuple[int, int, int, int]:
    """(words, characters, turns, images) of a record: what its token count grows with. A video counts the
    visuals its dataset gives at most (``visual_count``: ``max_frames`` frames, or one visual)."""
    record = leaf.records[local]
    texts = (*record.instructions, *record.outputs, *((record.system,) if record.system else ()))  # its own system
    images = leaf.visual_count(local) if hasattr(leaf, "visual_count") else \
        len(record.images) + (leaf.max_frames if record.video else 0)
    return sum(len(text.split()) for text in texts), sum(map(len, texts)), len(record.instructions), images


@dataclass(frozen=True)
class TokenEstimate:
    """Tokens of a sample ~ ``per_word * words + per_char * characters + per_turn * turns + per_image * images +
    fixed + margin``, at most ``longest``. Words and characters both: a BPE gives about one token per common word
    and splits rare ones into pieces. The margin puts the estimate on the high side: a micro-batch planned a
    little under its budget pads a little, one planned over it needs a whole row more."""

    per_word: float
    per_char: float
    per_turn: float
    per_image: float
    fixed: float
    longest: int  # the model truncates there (model.max_txt_len)
    margin: float = 0.0  # the fit's 90th-percentile underestimate

    def __str__(self) -> str:
        return (f"a sample's tokens estimated as {self.per_word:.2f}/word + {self.per_char:.3f}/character + "
                f"{self.per_turn:.1f}/turn + {self.per_image:.1f}/image + {self.fixed:.1f} + {self.margin:.1f} "
                "(fitted on exact counts)")

    def tokens(self, shape: tuple[int, int, int, int], image_tokens: int = 0) -> int:
        """The estimate for a record of ``shape`` whose images take ``image_tokens`` placeholders (known exactly)."""
        words, chars, turns, images = shape
        guess = (self.per_word * words + self.per_char * chars + self.per_turn * turns + self.per_image * images
                 + self.fixed + self.margin + image_tokens)
        return int(min(max(round(guess), 1), self.longest))


def fit_token_estimate(shapes: list[tuple[int, int, int, int]], exact: list[int], longest: int,
                       image_tokens: list[int] | None = None) -> TokenEstimate:
    """The least-squares ``TokenEstimate`` of ``exact`` token counts from record ``shapes``, less each sample's
    ``image_tokens`` where they are known exactly (the fit then covers the text around the images). Samples the
    model truncated say nothing about how tokens grow with words, so they are left out of the fit."""
    known = image_tokens if image_tokens is not None else [0] * len(exact)
    exact = [n - m for n, m in zip(exact, known, strict=True)]
    rows = [(shape, n) for shape, n, m in zip(shapes, exact, known) if n + m < longest] or list(zip(shapes, exact))
    features = torch.tensor([[*shape, 1.0] for shape, _ in rows], dtype=torch.float64)
    target = torch.tensor([[float(n)] for _, n in rows], dtype=torch.float64)
    # gelsd: least squares that tolerates a column the sample does not vary (every sample one image)
    solution = torch.linalg.lstsq(features, target, driver="gelsd").solution
    underestimates = (target - features @ solution).flatten()
    margin = max(0.0, float(torch.quantile(underestimates, 0.9)))
    return TokenEstimate(*solution.flatten().tolist(), longest=longest, margin=margin)


def token_length_of(dataset: Dataset, count_tokens: Callable[[list[dict[str, Any]]], list[int]],
                    longest: int, tokens_for_image: Callable[[tuple[int, ...]], int] | None = None
                    ) -> Callable[[int, int], int]:
    """``(index, epoch) -> estimated tokens`` of the training set's samples. ``count_tokens`` gives the exact
    tokens of text-only samples (the model's ``prepare_batch`` on ``instruction``/``output``/``num_images``);
    ``tokens_for_image`` (the model's) each image's tokens from its size, for records whose dataset gives their
    images' sizes (``image_sizes``)."""
    setting = "run.batch_unit=tokens"
    step = max(1, len(dataset) // CALIBRATION_SAMPLES)
    picked = [leaf_of(dataset, i, 0, setting) for i in range(0, len(dataset), step)][:CALIBRATION_SAMPLES]
    shapes = [shape_of(leaf, local) for leaf, local in picked]
    texts = []
    for leaf, local in picked:
        sample = leaf.text_sample(local) if hasattr(leaf, "text_sample") else None
        if sample is None:
            raise InputError(f"{setting}: {type(leaf).__name__} cannot give a sample's text without its images "
                             "(text_sample), so its token counts cannot be estimated; use run.batch_unit=samples")
        texts.append(sample)
    def image_tokens(leaf: Dataset, local: int) -> int:
        sizes = leaf.image_sizes(local) if tokens_for_image and hasattr(leaf, "image_sizes") else None
        return 0 if sizes is None else sum(tokens_for_image(size) for size in sizes)

    estimate = fit_token_estimate(shapes, count_tokens(texts), longest,
                                  [image_tokens(leaf, local) for leaf, local in picked])
    # Each record's estimate, kept once made: a record's words cost ~20 us to read (about 13 s for a 665k mix,
    # once); a later epoch, or another sample drawing the same record, only looks it up.
    known: dict[int, np.ndarray] = {}  # id(leaf dataset) -> estimated tokens per record, 0 = not made yet

    def length_of(index: int, epoch: int) -> int:
        leaf, local = leaf_of(dataset, index, epoch, setting)
        tokens = known.get(id(leaf))
        if tokens is None:
            tokens = known[id(leaf)] = np.zeros(len(leaf.records), dtype=np.int32)
        if not tokens[local]:
            tokens[local] = estimate.tokens(shape_of(leaf, local), image_tokens(leaf, local))
        return int(tokens[local])

    length_of.estimate = estimate  # for the log line that says how the plan was made
    return length_of


def counted_by(prepare_batch: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[list[dict]], list[int]]:
    """Exact tokens of text-only samples (``text_sample``'s) as a model's ``prepare_batch`` lays them out for
    training; no image is read. A sample truncation would cut into an image (which training drops or refuses)
    counts its whole length: the fit leaves out samples at the model's limit."""
    def batch_of(samples: list[dict]) -> dict[str, Any]:
        batch = {key: [sample.get(key) for sample in samples] for key in ("instruction", "output", "num_images",
                                                                           "system")}
        batch["image"] = torch.empty((sum(batch["num_images"]), 0))  # stands for the images: their count only
        sizes = [sample.get("image_sizes") for sample in samples]
        if all(s is not None for s in sizes):  # what the model's tokens_for_image counts the images by
            batch["image_sizes"] = [size for sample_sizes in sizes for size in sample_sizes]
        return batch

    def tokens(samples: list[dict]) -> list[int]:
        return prepare_batch(batch_of(samples))["attention_mask"].sum(dim=1).tolist()

    def count(samples: list[dict]) -> list[int]:
        try:
            return tokens(samples)
        except ImageSpanCut:  # one by one, to find the cut ones
            counts = []
            for sample in samples:
                try:
                    counts += tokens([sample])
                except ImageSpanCut as cut:
                    counts.append(cut.length)
            return counts
    return count
