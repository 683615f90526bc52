"""Where the LLM's weights live while a model is built: the runner chooses, the model follows.

A 72B LLM in bf16 is 145 GB; eight processes of a node each building it whole before the
engine partitions it would need over 1 TB of host memory. So the runner that will shard
the LLM says, while the model is built, how this process builds it:

- ``whole`` (default: one process, ZeRO 0-2, export, inference): every process builds and
  loads all of it.
- ``zero3`` (``runner_deepspeed`` at ZeRO stage 3, with transformers' ``HfDeepSpeedConfig``
  alive): built partitioned from the start. transformers builds it under
  ``deepspeed.zero.Init`` and loads it module by module; process 0 alone reads the weight
  files (the others read only their headers) and every process keeps its partition.
- ``rank0`` (``runner_fsdp`` on several processes): process 0 builds and loads it whole; the
  others build it on the meta device (no memory, no file read) and receive their shards from
  process 0 once FSDP has sharded the model.

The LLM is built with the random number generator forked: however a placement draws random
numbers (zero.Init initialises weights that loading then overwrites, meta tensors draw
nothing), the parts built after it (projection, LoRA adapters) get the same initial weights
in every placement, so a partitioned build trains exactly as a whole one.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn

from lavis_ds.common import dist

Placement = Literal["whole", "zero3", "rank0"]
PLACEMENTS: tuple[Placement, ...] = ("whole", "zero3", "rank0")

# Set only inside `llm_placement(...)` and reset when it ends: a run's build, not the process, owns it.
_PLACEMENT: contextvars.ContextVar[Placement] = contextvars.ContextVar("lavis_ds_llm_placement", default="whole")


@contextlib.contextmanager
def llm_placement(placement: Placement) -> Iterator[None]:
    """Build LLMs with ``placement`` inside this block (see the module docstring)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"LLM placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    token = _PLACEMENT.set(placement)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def current_placement() -> Placement:
    """The placement of the ``llm_placement`` block this code runs in (``whole`` outside any)."""
    return _PLACEMENT.get()


def builds_empty() -> bool:
    """Whether this process builds the LLM on the meta device, to receive its shards later (``rank0``)."""
    return current_placement() == "rank0" and dist.rank() != 0


def is_partitioned(params: list[nn.Parameter]) -> bool:
    """Whether any of ``params`` is partitioned by DeepSpeed ZeRO-3 (holds only its shard)."""
    return any(hasattr(p, "ds_id") for p in params)


def gathered(params: list[nn.Parameter], modifier_rank: int | None = None):
    """A context in which ZeRO-3 partitioned ``params`` are whole; a no-op for ordinary parameters.

    With ``modifier_rank=0`` what process 0 writes into them is what every process keeps.
    """
    if not is_partitioned(params):
        return contextlib.nullcontext()
    import deepspeed  # only reached for ZeRO-3 parameters

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def partition_like_the_rest(model: nn.Module, params: list[nn.Parameter]) -> None:
    """Partition the whole ``params`` of a model whose other parameters ZeRO-3 partitioned, as they are.

    transformers resizes embeddings under ZeRO-3 into whole new matrices (DeepSpeed would partition
    them only in ``deepspeed.initialize``): without this every process would keep them whole until then.
    Process 0's values are what every process keeps. Every process must call it.
    """
    zero_param = next((p for p in model.parameters() if hasattr(p, "ds_id")), None)
    whole = [p for p in params if not hasattr(p, "ds_id")]
    if zero_param is not None and whole:
        zero_param.convert_to_zero_parameters(param_list=whole)  # the zero.Init that built the rest


def empty_weights():
    """Parameters created in this block are on the meta device; buffers stay real (rotary tables are
    computed at construction and are not in any state dict, so nobody would send them)."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def copy_into_partitioned(target: nn.Module, source: nn.Module | None) -> None:
    """Copy ``source`` (whole, on process 0 only; None elsewhere) into the ZeRO-3 partitioned ``target``.

    One module at a time is gathered, written by process 0 and partitioned again, so no
    other process ever holds more than one module whole. Every process must call it.
    """
    source_modules = dict(source.named_modules()) if source is not None else {}
    for name, module in target.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        with gathered(params, modifier_rank=0), torch.no_grad():
            if source is not None:
                for param_name, param in module.named_parameters(recurse=False):
                    param.copy_(getattr(source_modules[name], param_name))
