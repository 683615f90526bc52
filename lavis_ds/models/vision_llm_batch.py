"""Where each sample of a prepared batch sits: its images in packed order, the sample of each supervised position."""
from __future__ import annotations

from typing import Any

import torch

from lavis_ds.models.prompt import IGNORE_INDEX, image_counts


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
