"""Where each sample of a prepared batch sits: its images in packed order, the sample of each supervised position;
and the batch without the samples truncation would cut into an image (``prepare_batch``'s ``on_image_cut: drop``)."""
from __future__ import annotations

import logging
from typing import Any

import torch

from lavis_ds.common.errors import ImageSpanCut
from lavis_ds.models.image_tokens import GRID_KEY, SECONDS_KEY, SIZES_KEY, select_images
from lavis_ds.models.prompt import IGNORE_INDEX, image_counts

logger = logging.getLogger(__name__)

# Fields with a row (or block of rows) per image, not per sample.
IMAGE_KEYS = ("image", GRID_KEY, SIZES_KEY, SECONDS_KEY)


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


def sample_name(samples: dict[str, Any], i: int) -> str:
    """How messages name sample ``i`` of a batch: its dataset index where the batch has one."""
    index = samples.get("index")
    return f"sample {i} of the micro-batch" + ("" if index is None else f" (dataset index {int(index[i])})")


def log_drop(where: str, cut: ImageSpanCut, dropped: int) -> None:
    """The first few drops, then every hundredth: a log, not a flood; the count is this process's."""
    if dropped <= 5 or dropped % 100 == 0:
        logger.warning("lavis_ds: %s dropped: model.max_txt_len=%d would cut its image placeholders (its %d tokens, "
                       "the last placeholder at token %d); %d sample(s) dropped so far in this process "
                       "(run.sft.on_image_cut: drop)", where, cut.max_len, cut.length, cut.last_image_pos, dropped)


def keep_samples(samples: dict[str, Any], kept: list[int]) -> dict[str, Any]:
    """The batch with only the samples ``kept`` (indices, in order), each with its images. A field is per sample if
    it lists one entry per sample (a list, or a tensor whose first dimension is the batch's samples)."""
    size = len(samples["instruction"])
    counts = image_counts(samples)
    starts = [sum(counts[:i]) for i in range(size)]
    out = {**samples, **select_images(samples, [starts[i] + k for i in kept for k in range(counts[i])])}
    for key, value in samples.items():
        if key in IMAGE_KEYS or not isinstance(value, (list, tuple, torch.Tensor)) or len(value) != size:
            continue
        out[key] = value[torch.tensor(kept, dtype=torch.long)] if torch.is_tensor(value) else [value[i] for i in kept]
    if "image" in out and not sum(counts[i] for i in kept):
        out["image"] = samples["image"][:0]
    return out


def blank_sample(samples: dict[str, Any]) -> dict[str, Any]:
    """A one-sample batch without images or text, standing in for a micro-batch whose samples were all dropped."""
    kept = keep_samples(samples, [0])
    return {**kept, **select_images(samples, []), "instruction": [[""]], "output": [[""]], "num_images": [0],
            **({"image": samples["image"][:0]} if samples.get("image") is not None else {})}
