"""Running a model in its training precision: float inputs in the compute dtype, ops under autocast.

One definition for every place that runs the model (the engines, generation, chat), so that a
model answers at inference as it was run in training.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch


def to_compute(batch: dict[str, Any], device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
    """``batch`` with every tensor on ``device`` and every float tensor in ``dtype``.

    The copies are asynchronous (``non_blocking``): from pinned memory (the DataLoader pins on CUDA) a
    host-to-GPU copy then overlaps the GPU's work instead of stopping the host until it is done.
    """
    return {k: (v.to(device, dtype if v.is_floating_point() else None, non_blocking=True) if torch.is_tensor(v)
                else v) for k, v in batch.items()}


def autocast(device: torch.device | str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` (none for fp32): keeps ops that mix in fp32 tensors (buffers, masks) in ``dtype``."""
    device_type = torch.device(device).type
    return torch.autocast("cuda" if device_type == "cuda" else "cpu", dtype=dtype, enabled=dtype != torch.float32)
