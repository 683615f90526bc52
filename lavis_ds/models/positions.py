"""Position ids as part of the LLM contract: each LLM family says how its tokens are numbered.

A provider is a pure function of one sample's token ids and its visual inputs, computed on the host per sample
(``prepare_batch``), so that packing lays each sample's own ids end to end and a packed row equals its samples
padded. Two providers are registered (``lavis_ds.common.registry.position_providers``):

- ``rope_1d``: ``0..L-1``, one row; what every plain causal LM takes (packing's ``position_ids``).
- ``mrope``: Qwen2-VL's multimodal RoPE, three rows (temporal, height, width). A text token has equal ids in the
  three rows, one more than the token before it; an image's tokens take their (t, h, w) place in the image's grid
  of LLM tokens, offset by the text before it, and the text after it continues from the offset plus the larger
  of the grid's height and width. Equal to transformers' ``Qwen2VLModel.get_rope_index`` (and Qwen2.5-VL's, whose
  video temporal ids are spaced by ``tokens_per_second * second_per_grid_t``). A text model that reads packed
  sample boundaries from the plain positions takes a fourth row in front: ``0..L-1`` (``with_text_row``).

``rope_delta`` is what generation adds to the plain positions of every new token (transformers' ``rope_deltas``).
Which family takes which provider is a table in ``lavis_ds.models.llm_families``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lavis_ds.common.registry import position_providers


@dataclass(frozen=True)
class Visual:
    """One image or video as the LLM sees it: how many placeholder tokens it takes and, where it has one, its grid
    of LLM tokens (t, h, w after the tower's spatial merge; t*h*w == tokens) and the spacing of its temporal ids
    (Qwen2.5-VL video: ``tokens_per_second * second_per_grid_t``; 1 for images)."""

    tokens: int
    grid: tuple[int, int, int] | None = None
    time_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.grid is not None and self.grid[0] * self.grid[1] * self.grid[2] != self.tokens:
            raise ValueError(f"a visual of {self.tokens} tokens cannot have the grid {self.grid} of LLM tokens "
                             f"({self.grid[0] * self.grid[1] * self.grid[2]} tokens)")


class PositionProvider:
    """How a family numbers a sample's tokens: ``rows`` rows of ids per token."""

    rows: int = 1

    def positions(self, input_ids: Sequence[int], placeholder_ids: Sequence[int], visuals: Sequence[Visual]
                  ) -> torch.Tensor:
        """``[rows, len(input_ids)]`` long: the ids of one sample whose placeholder runs (tokens in
        ``placeholder_ids``) are ``visuals``' in order."""
        raise NotImplementedError

    def rope_delta(self, positions: torch.Tensor) -> int:
        """What generation adds to the plain position of each token after the prompt: 0 for 1-D positions."""
        return int(positions.max()) + 1 - positions.shape[-1] if positions.numel() else 0


@position_providers.register("rope_1d")
class TextPositions(PositionProvider):
    """``0..L-1``: one row, whatever the images (a Qwen-VL tower on a plain 1-D LLM is a valid mix)."""

    rows = 1

    def positions(self, input_ids, placeholder_ids, visuals) -> torch.Tensor:
        return torch.arange(len(input_ids)).unsqueeze(0)


@position_providers.register("mrope")
class MultimodalRope(PositionProvider):
    """Qwen2-VL's M-RoPE ids ``[3, L]`` (see the module docstring). A visual without a grid (a Q-Former's queries)
    is numbered as text is."""

    rows = 3

    def positions(self, input_ids, placeholder_ids, visuals) -> torch.Tensor:
        is_placeholder = torch.isin(torch.as_tensor(list(input_ids), dtype=torch.long),
                                    torch.as_tensor(list(placeholder_ids), dtype=torch.long)).tolist()
        pieces, start, current, pending = [], 0, 0, list(visuals)
        position = 0
        while position < len(is_placeholder):
            if not is_placeholder[position]:
                position += 1
                continue
            text = position - start
            pieces.append(torch.arange(text).expand(3, -1) + current)
            current += text
            if not pending:
                raise ValueError(f"placeholder token {position} has no visual left to number ({len(visuals)} given)")
            visual = pending.pop(0)
            ids, current = _visual_ids(visual, current)
            pieces.append(ids)
            position = start = position + visual.tokens
        if pending:
            raise ValueError(f"{len(pending)} of {len(visuals)} visual(s) have no placeholder run in the sample")
        pieces.append(torch.arange(len(is_placeholder) - start).expand(3, -1) + current)
        return torch.cat(pieces, dim=1).long()


def _visual_ids(visual: Visual, start: int) -> tuple[torch.Tensor, int]:
    """The ``[3, tokens]`` ids of one visual placed at ``start``, and where the text after it continues."""
    if visual.grid is None:
        return torch.arange(visual.tokens).expand(3, -1) + start, start + visual.tokens
    t, h, w = visual.grid
    # transformers' get_vision_position_ids: temporal ids scaled, then truncated to integers, then offset
    temporal = (torch.arange(t) * visual.time_interval).long() + start
    grid_t, grid_h, grid_w = torch.meshgrid(temporal, torch.arange(h) + start, torch.arange(w) + start,
                                            indexing="ij")
    return torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1), start + max(h, w)


def with_text_row(positions: torch.Tensor) -> torch.Tensor:
    """``[1 + rows, L]``: the plain ``0..L-1`` in front of a sample's provider rows (the row a text model reads
    packed sample boundaries from)."""
    return torch.cat([torch.arange(positions.shape[-1]).unsqueeze(0), positions])
