"""A batch's samples as the LLM receives them (token ids, labels, padded or packed), and where each sample of a
prepared batch sits: its images in packed order, the sample of each supervised position.

``token_batch`` is the one function that turns samples into what trains: the model's ``prepare_batch`` calls it,
and so does ``lavis_ds.show_sample``, which shows those very ids.
"""
from __future__ import annotations

from typing import Any

import torch

from lavis_ds.models.chat_template import ChatTemplateError
from lavis_ds.models.packing import pack
from lavis_ds.models.prompt import IGNORE_INDEX, ChatPrompt, image_counts, pad_batch


def sample_names(samples: dict[str, Any]) -> list[str]:
    """How messages name each sample of a batch: its ``where`` (its record's file and position; a pair's side),
    else its record index."""
    count = len(samples["instruction"])
    if samples.get("where") is not None and None not in samples["where"]:
        return list(samples["where"])
    index = samples.get("index")
    return [f"record {int(i)}" for i in index] if index is not None else [f"sample {i} of the batch"
                                                                          for i in range(count)]


def training_examples(prompt: ChatPrompt, samples: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of each sample: its turns, its real image count, its own system turn (if any)."""
    systems = samples.get("system") or [None] * len(samples["instruction"])
    examples = []
    for name, instructions, answers, num_images, system in zip(
            sample_names(samples), samples["instruction"], samples["output"], image_counts(samples), systems,
            strict=True):
        try:
            examples.append(prompt.training_example(instructions, answers, num_images, system))
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{name}: {e}") from None
    return examples


def token_batch(prompt: ChatPrompt, samples: dict[str, Any], pad_id: int, pack_to: int | None = None
                ) -> dict[str, Any]:
    """The LLM's fields of a batch: ``input_ids``, ``attention_mask``, ``labels`` padded on the right, or with
    ``pack_to`` the samples laid end to end in rows of at most that many tokens (``models.packing``: adds
    ``position_ids``, per-sample lengths and the packed ``order``)."""
    examples = training_examples(prompt, samples)
    if pack_to is not None:
        return pack(examples, pack_to, pad_id, IGNORE_INDEX)
    input_ids, attention_mask = pad_batch([ids for ids, _ in examples], pad_id, side="right")
    labels, _ = pad_batch([lab for _, lab in examples], IGNORE_INDEX, side="right")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def packed_image_order(samples: dict[str, Any]) -> torch.Tensor:
    """Indices into the flat image tensor (each sample's images a block, in sample order) that list the images in
    the packed order of their samples."""
    counts = image_counts(samples)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return torch.tensor([starts[i] + k for i in samples["order"] for k in range(counts[i])], dtype=torch.long)


def sample_of_positions(samples: dict[str, Any], rows: torch.Tensor, labels: torch.Tensor
                        ) -> tuple[torch.Tensor, int]:
    """``(owner, num_samples)``: the sample (index in ``samples["instruction"]``) of each supervised position, in
    the row-major order ``lm_loss.token_logps`` lists them (``rows``: the batch row of each).

    Padded, a row is a sample. Packed (``position_ids``), a sample starts where its positions restart at 0 inside
    a row's filled part (``attention_mask`` 1); the tails restart at 0 too but are never filled nor supervised.
    The packed samples are laid out in ``samples["order"]``.
    """
    if "position_ids" not in samples:
        return rows, labels.shape[0]
    positions = samples["position_ids"].to(labels.device)
    filled = samples["attention_mask"].to(labels.device).bool()
    starts = (positions == 0) & filled
    packed_index = starts.flatten().cumsum(0).view_as(starts) - 1  # which packed sample each position belongs to
    order = torch.tensor(samples["order"], dtype=torch.long, device=labels.device)
    supervised = labels[:, 1:] != IGNORE_INDEX
    # Position t predicts token t+1, which belongs to the same sample: a sample's first token is never supervised.
    owner = order[packed_index[:, 1:][supervised]]
    return owner, len(samples["order"])
