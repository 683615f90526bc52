"""Padding-free packing: a micro-batch's tokenized samples laid end to end in rows of at most ``max_len`` tokens.

Padding every sample to the micro-batch's longest one wastes most of the compute on a real
instruction mix (answers from one token to hundreds). Packed, a row holds several samples, and
each sample still sees only itself:

- ``position_ids`` restart at 0 for every sample. transformers (the masking utilities of 4.5x and
  later) reads sample boundaries from them when no attention mask is given: SDPA and eager get a
  block-diagonal causal mask, flash-attention 2 its variable-length kernel.
- Labels are the samples' own. The token predicted across a boundary (the first token of the next
  sample) is a prompt token, never supervised, so no loss crosses samples.
- A row's unused tail is padding with positions restarting at 0: a "sample" of its own that no
  real token attends to, and that is never supervised.

The plan is a pure function of the samples (``plan_rows``), so a resumed step packs exactly as the
original did. Rows list samples in plan order; ``order`` says
which sample each is, so the images (filled into placeholders in row-major order) follow.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def plan_rows(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Sample indices per row, each row <= ``max_len``: first fit in the samples' order or first fit decreasing
    (longest first, ties in sample order), whichever needs fewer rows (in order on a tie). In order, a
    micro-batch planned by a token budget (``datasets.samplers.fill_rows``, which lays samples out the same
    way) gets the rows it was planned for; decreasing is usually tighter for samples drawn at random."""
    too_long = [i for i, n in enumerate(lengths) if n > max_len]
    if too_long:
        raise ValueError(f"sample {too_long[0]} has {lengths[too_long[0]]} tokens, more than a packed row's "
                         f"{max_len} (run.max_seq_len)")
    in_order = _first_fit(range(len(lengths)), lengths, max_len)
    decreasing = _first_fit(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), lengths, max_len)
    return decreasing if len(decreasing) < len(in_order) else in_order


def _first_fit(order: Iterable[int], lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Each sample of ``order`` into the first row with room for it."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(max_len)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def pack(examples: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int, pad_id: int,
         ignore_index: int, rope_positions: Sequence[torch.Tensor] | None = None
         ) -> dict[str, torch.Tensor | list[int]]:
    """``examples`` (input_ids, labels) packed: ``input_ids``, ``labels``, ``position_ids`` ``[rows, longest row]``,
    ``attention_mask`` (1 where a token stands, 0 in the tails: for counting, the model passes positions instead),
    ``sample_lengths`` (for counting attention FLOPs), ``order`` (the sample index of each packed sample, in row-major order)
    and ``row_spans`` (each row's sample lengths then its tail's, if any: host integers for the layers that need the
    boundaries beside the positions, ``lavis_ds.models.linear_attention``).

    ``rope_positions``: each sample's own ``[k, L]`` ids of a family with k rows (M-RoPE's three), laid end to end
    the same way as ``rope_position_ids [k, rows, longest row]`` (the tails as ``position_ids``'s, in every row)."""
    rows = plan_rows([len(ids) for ids, _ in examples], max_len)
    width = max(sum(len(examples[i][0]) for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), ignore_index, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            ids, labs = examples[i]
            span = slice(start, start + len(ids))
            input_ids[r, span] = torch.tensor(list(ids), dtype=torch.long)
            labels[r, span] = torch.tensor(list(labs), dtype=torch.long)
            positions[r, span] = torch.arange(len(ids))
            start += len(ids)
        positions[r, start:] = torch.arange(width - start)  # the tail: its own span, seen by no real token
    filled = torch.tensor([sum(len(examples[i][0]) for i in row) for row in rows])
    attention_mask = (torch.arange(width).unsqueeze(0) < filled.unsqueeze(1)).long()
    packed = {"input_ids": input_ids, "labels": labels, "position_ids": positions, "attention_mask": attention_mask,
              "sample_lengths": torch.tensor([len(ids) for ids, _ in examples]),
              "order": [i for row in rows for i in row],
              "row_spans": [[len(examples[i][0]) for i in row] + ([width - int(n)] if n < width else [])
                            for row, n in zip(rows, filled)]}
    if rope_positions is not None:
        packed["rope_position_ids"] = _laid_out(rope_positions, rows, positions, filled)
    return packed


def _laid_out(per_sample: Sequence[torch.Tensor], rows: list[list[int]], positions: torch.Tensor,
              filled: torch.Tensor) -> torch.Tensor:
    """Each sample's ``[k, L]`` ids end to end in its row, ``[k, rows, width]``; the tails as ``positions``'."""
    out = positions.unsqueeze(0).repeat(per_sample[0].shape[0] if per_sample else 1, 1, 1)
    for r, row in enumerate(rows):
        out[:, r, :int(filled[r])] = torch.cat([per_sample[i] for i in row], dim=1)
    return out
