"""ZeRO-3's place for the LLM while the model is built: partitioned from the start.

transformers builds a model under ``deepspeed.zero.Init`` while a ZeRO-3 ``HfDeepSpeedConfig``
is alive, and loads it module by module: process 0 alone reads the weight files (the others
read only their headers) and every process keeps its partition. The build then reaches the
partitioned weights through this placement (``lavis_ds.models.llm_placement``).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from lavis_ds.common import dist
from lavis_ds.models.llm_placement import LLMPlacement, llm_placement
from lavis_ds.runners.deepspeed.library import load_deepspeed


class Zero3Placement(LLMPlacement):
    """The LLM built partitioned (needs ``zero3_construction``'s HfDeepSpeedConfig alive)."""

    def build(self, recipe):
        from transformers.integrations import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            raise RuntimeError("Zero3Placement needs a ZeRO-3 HfDeepSpeedConfig alive while the model is built")
        if recipe.path is not None:
            return recipe.whole()  # from_pretrained: partitioned as it loads
        # A random initialisation is process 0's whole one, copied in module by module, so that the weights
        # are those of a whole build with the same seed (zero.Init initialises otherwise).
        whole = recipe.whole() if dist.rank() == 0 else None
        llm = recipe.from_config()
        copy_into_partitioned(llm, whole)
        return llm

    def gathered(self, params, modifier_rank=None):
        return gathered(params, modifier_rank)

    def partition_like_the_rest(self, model, params):
        """transformers resizes embeddings under ZeRO-3 into whole new matrices (DeepSpeed would partition them
        only in ``deepspeed.initialize``): without this every process would keep them whole until then.
        Process 0's values are what every process keeps. Every process must call it."""
        zero_param = next((p for p in model.parameters() if hasattr(p, "ds_id")), None)
        whole = [p for p in params if not hasattr(p, "ds_id")]
        if zero_param is not None and whole:
            zero_param.convert_to_zero_parameters(param_list=whole)  # the zero.Init that built the rest


@contextlib.contextmanager
def zero3_construction(ds_config: dict):
    """While the model is built: transformers sees this ZeRO-3 config (its ``HfDeepSpeedConfig`` lives only
    as long as this block) and the LLM is placed partitioned."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(ds_config)  # transformers holds only a weak reference to it
    try:
        with llm_placement(Zero3Placement()):
            yield
    finally:
        unset_hf_deepspeed_config()  # later from_pretrained calls (export, inference) build whole again
        del hf_config


def is_partitioned(params: list[nn.Parameter]) -> bool:
    """Whether any of ``params`` is partitioned by ZeRO-3 (holds only its partition)."""
    return any(hasattr(p, "ds_id") for p in params)


def gathered(params: list[nn.Parameter], modifier_rank: int | None = None):
    """A context in which ZeRO-3 partitioned ``params`` are whole; with ``modifier_rank=0`` what process 0 writes
    into them is what every process keeps. A no-op for whole parameters."""
    if not is_partitioned(params):
        return contextlib.nullcontext()
    deepspeed = load_deepspeed()

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def gathered_root(module: nn.Module):
    """A context in which the module's own parameters (not its children's) are whole: generate() is not
    forward(), so ZeRO-3's hooks do not gather them (the query tokens of BLIP2-Qwen)."""
    return gathered(list(module.parameters(recurse=False)))


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
