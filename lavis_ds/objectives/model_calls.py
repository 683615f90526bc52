"""What a preference objective asks the model: image features once per pair, answer log-probs of both sides.

A pair micro-batch (``lavis_ds.datasets.preference.PairDataset.collater``) holds B pairs: their shared prompt
turns (``instruction``, and ``output``: the answers of the earlier turns), their images (``image``,
``num_images``) and the two last answers (``chosen``, ``rejected``). ``side_batch`` lays it out as one
sequence micro-batch of 2B samples, the B chosen sides then the B rejected sides, in which only each
sample's last answer is supervised (the earlier answers are prompt). The vision tower runs once, on the B
pairs' images; both sides take the same features, and one LLM forward scores all 2B answers.

The model interface is ``image_features(samples)`` and ``answer_logps(samples, image_features)`` of the
shared vision-LLM core (``lavis_ds.models.vision_llm``). ``prepare_pairs`` lays the pair micro-batch out flat
on the host: the 2B sides' token fields (``input_ids``, ``attention_mask``, ``labels``) beside the B pairs'
images, so that moving a batch to the device (``common.precision.to_compute``) moves every tensor it holds.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lavis_ds.common.errors import LavisDsError
from lavis_ds.models.image_tokens import FRAME_SECONDS_KEY, GRID_KEY, SECONDS_KEY, SIZES_KEY, batch_images
from lavis_ds.models.vision_llm_batch import with_supervised_positions

# What describes each image beside its pixels (Qwen-VL's grid rows, video seconds and frame times; sizes of a batch
# for counting): every side carries the pair's images' rows, so that it counts and numbers their placeholders as the
# model does.
IMAGE_LAYOUT_KEYS = (GRID_KEY, SIZES_KEY, SECONDS_KEY, FRAME_SECONDS_KEY)

IGNORE_INDEX = -100  # lavis_ds.models.prompt.IGNORE_INDEX (common to every model of the zoo)


def side_batch(pairs: dict[str, Any]) -> dict[str, Any]:
    """The 2B sequence samples of B pairs: chosen sides, then rejected sides, sharing prompt turns, images and the
    pair's own system turn."""
    history = pairs.get("output") or [[] for _ in pairs["instruction"]]
    image = pairs.get("image")
    index = pairs.get("index")
    names = pairs.get("where") or (None if index is None else [f"pair {int(i)}" for i in index])
    where = None if names is None else [f"{name} ({side})" for side in ("chosen", "rejected") for name in names]
    return {
        "instruction": [list(turns) for turns in pairs["instruction"]] * 2,
        "output": ([list(h) + [c] for h, c in zip(history, pairs["chosen"], strict=True)]
                   + [list(h) + [r] for h, r in zip(history, pairs["rejected"], strict=True)]),
        "num_images": list(pairs["num_images"]) * 2,
        "system": list(pairs.get("system") or [None] * len(pairs["instruction"])) * 2,  # a pair's own system turn
        "where": where,  # names a side in errors (models.vision_llm_batch.sample_names)
        # the pixels are not run twice (answer_logps takes the features); the layout check counts them
        "image": None if image is None else torch.cat([image, image]),
        **{key: _twice(pairs[key]) for key in IMAGE_LAYOUT_KEYS if pairs.get(key) is not None},
    }


def _twice(value: Any) -> Any:
    return torch.cat([value, value]) if torch.is_tensor(value) else list(value) * 2


def last_answer_labels(labels: Tensor, turns: list[int], where: list[str] | None = None) -> Tensor:
    """``labels`` with only each row's last supervised span kept: its last answer and end-of-turn token.

    Answer spans are separated by unsupervised template tokens (the next turn's header), so the last run of
    supervised labels is the last answer, unless truncation cut it away: then the row has fewer runs than
    ``turns`` and this raises, naming the pair (``where``).
    """
    supervised = labels != IGNORE_INDEX
    starts = supervised & ~torch.nn.functional.pad(supervised, (1, 0))[:, :-1]  # a run starts here
    runs = starts.sum(1)
    short = [i for i, (n, t) in enumerate(zip(runs.tolist(), turns, strict=True)) if n < t]
    if short:
        names = [where[i] if where else f"sample {i}" for i in short]
        raise LavisDsError(f"{', '.join(names)}: the last answer does not fit in model.max_txt_len (it was cut away); "
                           f"raise model.max_txt_len or shorten the prompt")
    run_index = starts.cumsum(1)  # which run each position is in (0 before the first)
    keep = supervised & (run_index == runs.unsqueeze(1))
    return labels.masked_fill(~keep, IGNORE_INDEX)


def prepare_pairs(model: torch.nn.Module, pairs: dict[str, Any]) -> dict[str, Any]:
    """The pair micro-batch prepared on the host: the 2B sides tokenized by the model (chosen sides, then rejected
    sides; last answers supervised only, ``last_answer_labels``) and the B pairs' own images, once.

    Keys: the sides' (``input_ids``, ``attention_mask``, ``labels``, ``instruction``, ``output``, and the model's
    image path's ``host_inputs``), ``image`` and ``num_images`` of the pairs, ``chosen``, ``rejected``, ``index`` and
    the other keys of ``pairs``, and ``num_pairs``.
    """
    sides = model.prepare_batch(side_batch(pairs))
    images = 0 if pairs.get("image") is None else pairs["image"].shape[0]
    per_image = getattr(getattr(model, "image_path", None), "PER_IMAGE_FIELDS", ())
    for key in per_image:  # the sides' rows per image: chosen's first, then rejected's
        if images and key in sides and sides[key].shape[0] == 2 * images:
            sides[key] = sides[key][:images]  # the pair's images, once (both sides ask the same instruction of them)
    for key in IMAGE_LAYOUT_KEYS:  # the pairs' images' rows once, as the model prepared them (Qwen-VL: host rows)
        if sides.get(key) is not None:
            sides[key] = sides[key][:batch_images(pairs)]
    turns = [len(turns) for turns in sides["instruction"]]
    labels = last_answer_labels(sides["labels"], turns, sides["where"])
    return with_supervised_positions({**pairs, **sides, "labels": labels, "image": pairs.get("image"),
                                      "num_images": list(pairs["num_images"]), "num_pairs": len(pairs["chosen"])})


def image_features(model: torch.nn.Module, batch: dict[str, Any]) -> Tensor:
    """Projected image features of the pairs' images for both sides, flat ``[2 x image tokens, hidden]``: the
    vision pass runs once, on the pairs' N images; the chosen and the rejected sides take the same features."""
    features = model.image_features(batch)
    return torch.cat([features, features])


def answer_logps(model: torch.nn.Module, batch: dict[str, Any], features: Tensor) -> tuple[Tensor, Tensor]:
    """``(logp_sum [2B], num_tokens [2B])`` of each side's supervised tokens, both sides in one forward."""
    return model.answer_logps(batch, image_features=features)
