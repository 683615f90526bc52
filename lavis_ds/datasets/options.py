"""What a dataset section may set besides its data layout: one dataclass per builder family.

The field names are the YAML keys; the config validator checks a section against
its builder's ``OPTIONS`` dataclass (unknown key -> closest valid key, wrong type,
bad value), so the schema and the code cannot drift apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lavis_ds.datasets.coco_caption import DEFAULT_CAPTION_PROMPT, caption_instruction
from lavis_ds.datasets.loading import ALL_KINDS
from lavis_ds.datasets.records import BadRecord

# Section keys that describe where the data is and how it is processed (every builder reads them).
LAYOUT_KEYS = ("builder", "data_type", "build_info", "vis_processor", "text_processor")


@dataclass(frozen=True)
class SectionOptions:
    """Options every dataset section may set; the field names are the YAML keys.

    Attributes:
        sample_ratio: weight of this dataset in the training epoch when several train
            together (MiniGPT-4's key); set it on every training dataset or on none.
        skip_bad_records: leave malformed records and records whose image file is
            missing out at load time (one warning with the count and the first few),
            and replace a sample whose image does not decode by the next readable
            record (each logged and counted). Default: each of those is an error
            naming the annotation file and the record.
        metrics: registered metric names scoring this dataset's test and validation
            splits instead of ``run.test_metrics`` / ``run.val_metrics``.
    """

    sample_ratio: float | None = None
    skip_bad_records: bool = False
    metrics: list[str] | None = None

    def __post_init__(self) -> None:
        ratio = self.sample_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"sample_ratio: must be a positive number, got {ratio!r}")

    def skipped_kinds(self) -> frozenset[str]:
        """Kinds of bad record to leave out instead of raising."""
        return ALL_KINDS if self.skip_bad_records else frozenset()


@dataclass(frozen=True)
class LlavaOptions(SectionOptions):
    """Plus ``skip_text_only``: leave records without an image out (counted and logged) instead of
    training them as text-only samples (the default)."""

    skip_text_only: bool = False

    def skipped_kinds(self) -> frozenset[str]:
        return super().skipped_kinds() | ({BadRecord.TEXT_ONLY} if self.skip_text_only else set())


@dataclass(frozen=True)
class CocoCaptionOptions(SectionOptions):
    """Plus ``prompt``: the instruction of every caption sample (the image goes in front of it
    unless it contains ``<Img><ImageHere></Img>``)."""

    prompt: str = DEFAULT_CAPTION_PROMPT

    def __post_init__(self) -> None:
        super().__post_init__()
        caption_instruction(self.prompt)  # raises "prompt: ..." for an empty or double-image prompt


@dataclass(frozen=True)
class PairOptions(SectionOptions):
    """Plus ``pair_format``: how the annotation files write a preference pair (``lavis_ds.datasets.preference``):
    ``sharegpt`` (LLaMA-Factory's ranking format), ``swift`` (ms-swift's RLHF format), ``rlaif_v``, ``rlhf_v``,
    ``vlfeedback``."""

    pair_format: Literal["sharegpt", "swift", "rlaif_v", "rlhf_v", "vlfeedback"] = "sharegpt"
