"""A user's connector, registered from outside lavis_ds (named under `imports:`): 2x2 average pool + MLP.

Not part of lavis_ds: tests/test_towers_connectors.py imports it by name, as a run's `imports:` would.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from lavis_ds.common.registry import registry
from lavis_ds.models.connectors import Connector


@registry.register_connector("avgpool2x2_mlp")
class AvgPoolMlp(Connector):
    """Pools each 2x2 patch neighbourhood into one token (a quarter of the tokens), then Linear-GELU-Linear."""

    def __init__(self, *, vision_width: int, llm_width: int, hidden: int = 64):
        super().__init__(vision_width=vision_width, llm_width=llm_width)
        self.mlp = nn.Sequential(nn.Linear(vision_width, hidden), nn.GELU(), nn.Linear(hidden, llm_width))

    def tokens_per_image(self, vision_tokens: int) -> int:
        side = math.isqrt(vision_tokens)
        if side * side != vision_tokens or side % 2:
            raise ValueError(f"avgpool2x2_mlp needs an even square patch grid, got {vision_tokens} tokens")
        return (side // 2) ** 2

    def forward(self, features, inputs=None):
        n, tokens, width = features.shape
        side = math.isqrt(tokens)
        grid = features.transpose(1, 2).reshape(n, width, side, side)
        pooled = F.avg_pool2d(grid, 2).flatten(2).transpose(1, 2)
        return self.mlp(pooled)
