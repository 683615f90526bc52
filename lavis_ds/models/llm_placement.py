"""Where the LLM's weights live while a model is built: the engine chooses, the model follows.

A 72B LLM in bf16 is 145 GB; eight processes of a node each building it whole before the
engine partitions it would need over 1 TB of host memory. So the engine that will shard
the LLM hands the build an ``LLMPlacement`` (``Engine.setup.model_placement``), which says how
this process builds it and how the build reaches weights the engine holds in pieces:

- ``LLMPlacement`` (default: one process, export, inference, engines that shard later):
  every process builds and loads all of it.
- ``Rank0Placement`` (``runner_fsdp`` on several processes): process 0 builds and loads it
  whole; the others build it on the meta device (no memory, no file read) and receive their
  shards from process 0 once FSDP has sharded the model.
- an engine's own placement, defined beside the engine (the DeepSpeed engine's ZeRO-3 one builds
  the LLM partitioned from the start and gathers pieces when the build writes rows into them).

The LLM is built with the random number generator forked: however a placement draws random
numbers (a partitioned build initialises weights that loading then overwrites, meta tensors
draw nothing), the parts built after it (projection, LoRA adapters) get the same initial
weights in every placement, so a partitioned build trains exactly as a whole one.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol

from torch import nn
from transformers import PreTrainedModel

from lavis_ds.common import dist


class LLMRecipe(Protocol):
    """The LLM a model asks for (``lavis_ds.models.llm.Recipe``): the ways a placement can make it."""

    def whole(self) -> PreTrainedModel:
        """Built and loaded whole in this process."""

    def from_config(self) -> PreTrainedModel:
        """Built by transformers from its config alone, through ``_from_config`` (where engines hook in)."""

    def empty(self) -> PreTrainedModel:
        """Its structure on the meta device (only config.json is read)."""

    def with_file_dtype(self) -> LLMRecipe:
        """The same, in one dtype every process knows without reading the weights."""


class LLMPlacement:
    """Every process builds and loads the whole LLM."""

    def building(self) -> contextlib.AbstractContextManager:
        """The context the LLM is built and resized in."""
        return contextlib.nullcontext()

    def build(self, recipe: LLMRecipe) -> PreTrainedModel:
        return recipe.whole()

    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        """A context in which ``params`` are whole in every process; with ``modifier_rank=0``, what process 0
        writes into them is what every process keeps. Whole parameters: nothing to do."""
        return contextlib.nullcontext()

    def partition_like_the_rest(self, model: nn.Module, params: list[nn.Parameter]) -> None:
        """Hand ``params``, which the build made whole (resized embeddings), to the engine's pieces as the rest
        of ``model`` is. Whole parameters: nothing to do."""


class Rank0Placement(LLMPlacement):
    """Process 0 builds and loads the LLM whole; the others build it on the meta device, to receive their
    shards from process 0 once the engine sharded the model."""

    def building(self):
        return empty_weights() if dist.rank() != 0 else contextlib.nullcontext()

    def build(self, recipe):
        recipe = recipe.with_file_dtype()  # process 0 and the others agree on it without reading the weights
        return recipe.whole() if dist.rank() == 0 else recipe.empty()


# Set only inside `llm_placement(...)` and reset when it ends: a run's build, not the process, owns it.
_PLACEMENT: contextvars.ContextVar[LLMPlacement] = contextvars.ContextVar("lavis_ds_llm_placement",
                                                                          default=LLMPlacement())


@contextlib.contextmanager
def llm_placement(placement: LLMPlacement) -> Iterator[None]:
    """Build LLMs with ``placement`` inside this block (see the module docstring)."""
    if not isinstance(placement, LLMPlacement):
        raise TypeError(f"an LLM placement must be an LLMPlacement, got {placement!r}")
    token = _PLACEMENT.set(placement)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def current_placement() -> LLMPlacement:
    """The placement of the ``llm_placement`` block this code runs in (whole outside any)."""
    return _PLACEMENT.get()


def empty_weights():
    """Parameters created in this block are on the meta device; buffers stay real (rotary tables are
    computed at construction and are not in any state dict, so nobody would send them)."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def holds_pieces(params: list[nn.Parameter]) -> bool:
    """Whether some of ``params`` hold only this process's piece of the weight (an engine's partition or
    shard): empty outside the engine's gather, or a sharded DTensor."""
    from torch.distributed.tensor import DTensor

    return any(p.numel() == 0 or isinstance(p, DTensor) for p in params)
