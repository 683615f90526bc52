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


def cast_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The half dtype all parameters of a model were cast to (what a bf16/fp16 DeepSpeed engine does), else None."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return next(iter(dtypes)) if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16} else None


def as_trained(model: torch.nn.Module, batch: dict[str, Any]
               ) -> tuple[dict[str, Any], contextlib.AbstractContextManager]:
    """``(batch, context)`` to run ``model`` on ``batch`` as the DeepSpeed engine ran it in training.

    A model whose parameters are all bf16 (or fp16) gets float inputs in that dtype and
    runs under autocast (as the trainer feeds its engine); any other model gets the batch
    on its device (fp32 inputs stay fp32) and no autocast.
    """
    dtype = cast_dtype(model) or torch.float32
    device = next(model.parameters()).device
    return to_compute(batch, device, dtype), autocast(device, dtype)
