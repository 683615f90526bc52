"""Qwen3.5's hybrid language model in the LLM slot, packed exactly: each sample's Gated-DeltaNet state starts at zero.

Qwen3.5's text model (transformers ``qwen3_5_text``) puts three Gated-DeltaNet layers (linear attention) before each
full-attention layer (``config.layer_types``). The attention layers read packed sample boundaries from the restarting
``position_ids`` (``lavis_ds.models.packing``). A Gated-DeltaNet layer does not: it carries a recurrent state from
token to token and runs a causal 1-D convolution over the last ``linear_conv_kernel_dim`` tokens, so over a packed
row taken as one sequence both carry the end of one sample into the next (ms-swift #9565, transformers #46093).

transformers 5.24's layer takes the boundaries as keyword arguments that only the kernels read: ``cu_seq_lens_q``
(passed on as ``cu_seqlens`` to flash-linear-attention's ``chunk_gated_delta_rule``, which wants every sequence in
one row) and ``seq_idx`` (causal-conv1d's ``causal_conv1d_fn``: each token's sequence). Its torch fallback refuses
them. So ``PackedGatedDeltaNet``, given ``packed_samples`` (the spans ``packing`` laid out, found on the host):

- with both kernels installed and taking the boundaries: runs the rows as one sequence with ``cu_seqlens`` and
  ``seq_idx``, the kernels' variable-length path;
- otherwise (the torch path): runs every module with parameters once over the rows - the projections, the gated
  norm, and the convolution over the spans laid apart by the zeros its own padding puts before a sequence - and
  only the parameter-free chunked delta rule once per span (a sample, or a row's padding tail). So the number of
  module calls does not depend on how many samples a row holds: ZeRO-3, which gathers a module's parameters at
  each call, gathers alike on every rank.

Without ``packed_samples``, padded rows without a cache take the same torch path with one span per row. transformers'
layer itself (generation with its cache, the kernels' path) reads ``conv1d.weight`` without calling the module, which
ZeRO-3 would leave an empty partition below ``stage3_param_persistence_threshold`` wherever its engine's forward does
not catch the read (``generate``); it runs inside a call of ``conv1d`` (``CallableConv1d``), where the weight is whole.

An LLM with recurrent layers that lavis_ds passes no boundaries to (Qwen3.5-MoE, Qwen3-Next, Mamba hybrids, ...)
is refused under packing (``boundary_kwargs``) rather than trained with state leaking across samples.
"""
from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5GatedDeltaNet

from lavis_ds.common.errors import InputError

# Vision-language model types whose language model the LLM slot takes (a published Qwen3.5 folder holds the vision
# tower too; lavis_ds's architectures bring their own image path), by the model type of that language model.
LANGUAGE_MODEL_OF = {"qwen3_5": "qwen3_5_text"}


@dataclass(frozen=True)
class PackedSamples:
    """Where each packed sample lies: what a recurrent layer needs to start each one afresh.

    ``spans``: ``(row, start, end)`` of every sample and every row's padding tail, row-major, covering each row
    (host integers, for the per-span path). ``cu_seqlens``: ``[spans + 1]`` int64, the spans' starts with the rows
    laid end to end (flash-linear-attention's ``cu_seqlens``). ``seq_idx``: ``[1, rows * width]`` int32, each
    token's span (causal-conv1d's ``seq_idx``; the torch path's convolution lays the spans apart by it). Both
    tensors on the model's device.
    """

    spans: tuple[tuple[int, int, int], ...]
    cu_seqlens: torch.Tensor
    seq_idx: torch.Tensor

    @classmethod
    def of(cls, row_spans: Sequence[Sequence[int]], device: torch.device | str) -> PackedSamples:
        """From each row's span lengths (``packing.pack``'s ``row_spans``: its samples, then its tail)."""
        spans, lengths = [], []
        for row, parts in enumerate(row_spans):
            start = 0
            for length in parts:
                spans.append((row, start, start + int(length)))
                lengths.append(int(length))
                start += int(length)
        sizes = torch.tensor(lengths, dtype=torch.long)
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), sizes).unsqueeze(0)
        return cls(tuple(spans), cu_seqlens.to(device, non_blocking=True), seq_idx.to(device, non_blocking=True))


@functools.cache  # transformers picks the implementations once, when its modeling module is imported
def kernels_take_boundaries() -> bool:
    """Whether transformers runs Qwen3.5's causal convolution and delta rule through installed kernels that accept
    ``seq_idx`` and ``cu_seqlens`` (its ``use_kernel_func_from_hub_with_fallback`` wrappers say which they run).
    Anything else - the torch fallback, a wrapper of another shape - takes the exact per-span path."""
    needs = ((modeling_qwen3_5.causal_conv1d_fn, "seq_idx"), (modeling_qwen3_5.torch_chunk_gated_delta_rule,
                                                                "cu_seqlens"))
    for function, argument in needs:
        chosen = inspect.getclosurevars(function).nonlocals
        if not (chosen.get("is_new_implementation") and argument in chosen.get("applicable_params", ())):
            return False
    return True


class PackedGatedDeltaNet(Qwen3_5GatedDeltaNet):
    """Qwen3.5's Gated-DeltaNet layer that starts its state and convolution afresh at each packed sample
    (``packed_samples``), and reaches every module with parameters through a call of it on every path (ZeRO-3
    gathers a module's parameters at its call; transformers' layer reads ``conv1d.weight`` without one)."""

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                packed_samples: PackedSamples | None = None, **kwargs) -> torch.Tensor:
        rows, width, _ = hidden_states.shape
        if packed_samples is not None and cache is not None:  # packing lays out training batches
            raise ValueError("packed rows run without a cache (generation takes padded rows)")
        if cache is not None:  # generation: transformers' cached path
            return self.transformers_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if kernels_take_boundaries():
            if packed_samples is None:
                return self.transformers_forward(hidden_states, attention_mask=attention_mask, **kwargs)
            flat = hidden_states.reshape(1, rows * width, -1)
            out = self.transformers_forward(flat, cu_seq_lens_q=packed_samples.cu_seqlens,
                                            seq_idx=packed_samples.seq_idx, **kwargs)
            return out.reshape(rows, width, -1)
        if packed_samples is None:  # padded rows: one span each, their padding zeroed as transformers does
            hidden_states = modeling_qwen3_5.apply_mask_to_padding_states(hidden_states, attention_mask)
            packed_samples = PackedSamples.of([[width]] * rows, hidden_states.device)
        return self.per_span(hidden_states, packed_samples)

    def transformers_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """transformers' layer, run inside a call of ``conv1d`` (``CallableConv1d``): the weight it reads directly
        is gathered there under ZeRO-3 at any ``stage3_param_persistence_threshold``."""
        return self.conv1d(functools.partial(super().forward, hidden_states, **kwargs))

    def per_span(self, hidden_states: torch.Tensor, packed: PackedSamples) -> torch.Tensor:
        """transformers' torch path with each span's state and convolution starting at zero: what running the layer
        once per span computes, with each module with parameters called once."""
        rows, width, _ = hidden_states.shape
        mixed = ACT2FN[self.activation](causal_conv_per_span(self.conv1d, self.in_proj_qkv(hidden_states), packed))
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(rows, width, -1, self.head_k_dim)
        key = key.reshape(rows, width, -1, self.head_k_dim)
        value = value.reshape(rows, width, -1, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        # As transformers computes the decay: in fp32, so that exp(A_log) cannot overflow in half precision.
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
        if all(start == 0 and end == width for _, start, end in packed.spans):  # padded rows: all in one call
            core = modeling_qwen3_5.torch_chunk_gated_delta_rule(
                query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0].reshape(-1, self.head_v_dim)
        else:
            pieces = [modeling_qwen3_5.torch_chunk_gated_delta_rule(
                query[row:row + 1, start:end], key[row:row + 1, start:end], value[row:row + 1, start:end],
                g=g[row:row + 1, start:end], beta=beta[row:row + 1, start:end], use_qk_l2norm_in_kernel=True)[0]
                for row, start, end in packed.spans]
            core = torch.cat(pieces, dim=1).reshape(-1, self.head_v_dim)
        gate = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
        return self.out_proj(self.norm(core, gate).reshape(rows, width, -1))


def causal_conv_per_span(conv: nn.Conv1d, mixed: torch.Tensor, packed: PackedSamples) -> torch.Tensor:
    """The causal depthwise ``conv`` (``padding = kernel - 1``, as Qwen3.5's) over each span of ``mixed``
    ``[rows, width, channels]`` on its own, in one call of the module: the spans laid end to end with ``kernel - 1``
    zeros before each, the zeros the convolution's padding puts before a whole sequence, so that no output reads
    another span's tokens. One call whatever the number of spans, and through the module, so that ZeRO-3 gathers
    its weight (transformers' layer reads ``conv1d.weight`` directly)."""
    rows, width, channels = mixed.shape
    gap = conv.kernel_size[0] - 1
    # Each token's place in the spread layout: its own, shifted by the gaps before its span and before itself.
    placed = torch.arange(rows * width, device=mixed.device) + gap * (packed.seq_idx[0].long() + 1)
    spread = mixed.new_zeros(rows * width + gap * len(packed.spans), channels).index_copy(
        0, placed, mixed.reshape(rows * width, channels))
    convolved = conv(spread.t().unsqueeze(0))[0].t()  # [spread length + gap, channels]: causal outputs first
    return convolved.index_select(0, placed).reshape(rows, width, channels)


class CallableConv1d(nn.Conv1d):
    """Qwen3.5's causal convolution, which can also run code that reads its weight (transformers' cached and kernel
    paths pass ``conv1d.weight`` to their functions instead of calling the module): ``conv(read)`` returns
    ``read()``, inside this module's call, where ZeRO-3 gathers the weight (a read outside any call of the module
    finds an empty partition below ``stage3_param_persistence_threshold``)."""

    def forward(self, input_or_read):
        return input_or_read() if callable(input_or_read) else super().forward(input_or_read)


class Qwen3_5TextForCausalLM(Qwen3_5ForCausalLM):  # registered below for transformers' key renames
    """transformers' ``Qwen3_5ForCausalLM`` whose Gated-DeltaNet layers are ``PackedGatedDeltaNet``: the same
    parameters under the same names (checkpoints, LoRA targets, ZeRO-3 / FSDP units per decoder layer unchanged)."""

    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__(config)
        for module in self.modules():
            if type(module) is Qwen3_5GatedDeltaNet:
                # The classes alone change (no new state): transformers' decoder layer builds its own class by name.
                module.__class__ = PackedGatedDeltaNet
                module.conv1d.__class__ = CallableConv1d

    def as_transformers(self) -> Qwen3_5ForCausalLM:
        """This model as transformers' own class, in place (same parameters): what an export saves, so that its
        config.json names ``Qwen3_5ForCausalLM``. Packing refuses it then (``boundary_kwargs``): for export only."""
        for module in self.modules():
            if type(module) is PackedGatedDeltaNet:
                module.__class__ = Qwen3_5GatedDeltaNet
                module.conv1d.__class__ = nn.Conv1d
        self.__class__ = Qwen3_5ForCausalLM
        return self

    @classmethod
    def _from_config(cls, config: PretrainedConfig, **kwargs: Any):
        # A Qwen3.5 vision-language folder's config holds the language model's as its text_config.
        return super()._from_config(config.get_text_config(decoder=True), **kwargs)


# transformers applies its key renames (a vision-language folder's ``model.language_model.*`` to ``model.*``) to its
# own classes; a subclass defined elsewhere gets them where registered by name.
register_checkpoint_conversion_mapping(Qwen3_5TextForCausalLM.__name__,
                                       get_checkpoint_conversion_mapping(Qwen3_5TextConfig.model_type))


# Layer kinds of transformers' layer_types that hold no state from token to token, beside softmax attention's.
STATELESS_KINDS = frozenset({"mlp", "moe"})


def recurrent_kinds(layer_types: Sequence[str] | None) -> list[str]:
    """The ``layer_types`` entries that carry state from token to token: linear attention, Mamba-style ``hybrid``
    blocks, short convolutions (``conv``); not softmax attention of any kind, nor MLP / MoE blocks."""
    return sorted({kind for kind in layer_types or () if kind == "linear_attention"
                   or ("attention" not in kind and kind not in STATELESS_KINDS)})


def recurrent_layers(llm: nn.Module) -> list[str]:
    """What carries state from token to token in ``llm`` (empty for an attention-only LLM): its recurrent
    ``config.layer_types``, else its class where transformers marks it stateful without listing kinds (Mamba)."""
    recurrent = recurrent_kinds(getattr(getattr(llm, "config", None), "layer_types", None))
    return recurrent or ([type(llm).__name__] if getattr(llm, "_is_stateful", False) else [])


# The model types whose recurrent layers lavis_ds passes packed boundaries to (the folder's, or llm_config's).
PACKS_EXACTLY = frozenset({"qwen3_5_text", *LANGUAGE_MODEL_OF})


def refusal(llm_class: str, model_type: str, recurrent: Sequence[str]) -> str:
    """The one line that refuses packing for an LLM whose ``recurrent`` layers would carry state across samples."""
    return (f"run.packing: the LLM {llm_class} (model_type {model_type}) has recurrent layers ({', '.join(recurrent)}) "
            "whose state would carry from one packed sample into the next; lavis_ds passes packed sample boundaries "
            "to Qwen3.5's text model (qwen3_5_text) only. Set run.packing: false for this LLM")


def packing_problems(model_type: str | None) -> list[str]:
    """``run.packing`` against the LLM's ``model_type``, before anything is built: a causal LM with recurrent layers
    that lavis_ds passes no boundaries to is a config problem (unknown types are reported elsewhere)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if model_type in PACKS_EXACTLY or model_type not in CONFIG_MAPPING:
        return []
    llm_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(CONFIG_MAPPING[model_type], None)
    if llm_class is None:
        return []
    recurrent = recurrent_kinds(getattr(CONFIG_MAPPING[model_type](), "layer_types", None))
    recurrent = recurrent or ([llm_class.__name__] if getattr(llm_class, "_is_stateful", False) else [])
    return [refusal(llm_class.__name__, model_type, recurrent)] if recurrent else []


def model_packing_problems(run: dict, model: dict) -> list[str]:
    """``run.packing`` with an LLM whose recurrent layers would carry state across packed samples, from the
    ``model`` section (the config check calls it)."""
    model_type = packed_llm_type(model) if run.get("packing") else None
    return packing_problems(model_type) if model_type is not None else []


def packed_llm_type(model: dict) -> str | None:
    """The LLM's ``model_type`` as the ``model`` section gives it: its folder's config.json or
    ``model.llm_config`` (None where neither says)."""
    folder = model.get("llm_model")
    if isinstance(folder, str):
        try:
            model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):  # the build names an unreadable folder
            return None
    else:
        model_type = (model.get("llm_config") or {}).get("model_type")
    return model_type if isinstance(model_type, str) else None


def boundary_kwargs(llm: nn.Module, row_spans: Sequence[Sequence[int]] | None, device: torch.device | str
                    ) -> dict[str, Any]:
    """What ``llm`` takes beside ``position_ids`` to keep packed samples apart: ``packed_samples`` for Qwen3.5's
    text model, nothing for attention-only LLMs; an LLM whose recurrent layers would carry one sample's state into
    the next is refused."""
    if isinstance(llm, Qwen3_5TextForCausalLM):
        if row_spans is None:
            raise ValueError("a packed batch for Qwen3.5's text model needs packing's row_spans")
        return {"packed_samples": PackedSamples.of(row_spans, device)}
    recurrent = recurrent_layers(llm)
    if recurrent:
        raise InputError(refusal(type(llm).__name__, getattr(llm.config, "model_type", "?"), recurrent))
    return {}
