"""A module's train/eval mode for the length of a block (evaluation, the reference pass of preference objectives)."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """The module in eval mode, and back in the mode it was found in."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)
