"""How long a training sample is, roughly, without loading it: what length-grouped batching sorts by.

LLaVA's ``group_by_modality_length`` sorts by the words of a conversation, text-only samples apart
from image ones; the same here: a sample's length is the number of words of its turns, and a
text-only sample (no image) counts as negative so that it groups with its own kind. Reading the
words of a record costs microseconds; tokenizing every sample of a 665k mix up front would cost
minutes, and grouping needs no more than an order.
"""
from __future__ import annotations

import bisect

from torch.utils.data import ConcatDataset, Dataset

from lavis_ds.common.errors import InputError
from lavis_ds.common.seeding import SeededDataset
from lavis_ds.datasets.mixing import MixedDataset


def approximate_length(dataset: Dataset, index: int, epoch: int) -> int:
    """Words of sample ``index`` of ``epoch`` (negative: a sample without an image), through the wrappers."""
    if isinstance(dataset, SeededDataset):
        return approximate_length(dataset.dataset, index, epoch)
    if isinstance(dataset, MixedDataset):
        part, record = dataset.locate(index, epoch)
        return approximate_length(dataset.parts[part], record, epoch)
    if isinstance(dataset, ConcatDataset):
        part = bisect.bisect_right(dataset.cumulative_sizes, index)
        local = index - (dataset.cumulative_sizes[part - 1] if part else 0)
        return approximate_length(dataset.datasets[part], local, epoch)
    records = getattr(dataset, "records", None)
    if records is None:
        raise InputError(f"run.length_grouped: {type(dataset).__name__} cannot tell how long its samples are (it "
                         "has no `records` of instruction/output turns); set run.length_grouped=false")
    record = records[index]
    words = sum(len(text.split()) for text in (*record.instructions, *record.outputs))
    return words if getattr(record, "image", None) else -words
