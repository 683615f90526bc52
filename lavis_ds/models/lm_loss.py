"""The language-model loss without ``[B, T, vocab]`` logits: the LM head at the supervised positions only, in chunks.

A causal LM's forward applies its output head to every position. With Qwen's 151,936-token
vocabulary that tensor (and its gradient) is gigabytes, though only the answers are
supervised. Here the LLM's decoder gives the hidden states, the supervised ones are picked
(token t predicts token t+1), and the head (``get_output_embeddings()``: an ``nn.Linear``, a
``TokenRowsHead``, or a peft-wrapped layer) runs on them chunk by chunk, each chunk's
cross-entropy in fp32. The head is called as a module, never read as ``.weight``: ZeRO-3 gathers
parameters in module hooks, and FSDP2 unshards the root's parameters (head included) for the
root's forward.

``token_logps`` returns the log-probability of every supervised target and its position in the
batch; the loss is minus their sum, and ``lavis_ds.models.vision_llm`` groups them by sample for
preference objectives.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from lavis_ds.models.llm import base_llm
from lavis_ds.models.prompt import IGNORE_INDEX

# Families whose causal-LM forward is `head(decoder(...))`, optionally followed by a final logit soft-capping
# (Gemma 2's `final_logit_softcapping`, reproduced below). Any other family (e.g. Cohere's `logit_scale`,
# Granite's `logits_scaling`, or an architecture not checked against its transformers source) falls back to the
# full-logits path of its own forward, which is exact whatever it does.
HEAD_ONLY_FAMILIES = frozenset({"qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "qwen2_vl_text",
                                "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_5_text"})


def head_loss_supported(llm: PreTrainedModel) -> bool:
    """Whether the supervised-positions path reproduces ``llm``'s own logits exactly (``HEAD_ONLY_FAMILIES``)."""
    return getattr(llm.config, "model_type", None) in HEAD_ONLY_FAMILIES and llm.get_output_embeddings() is not None


def output_logits(llm: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """``llm``'s logits for ``hidden`` (final-norm outputs of its decoder), as its own forward computes them."""
    logits = llm.get_output_embeddings()(hidden)
    cap = getattr(llm.config, "final_logit_softcapping", None)
    if cap is not None:  # Gemma 2, in the logits' dtype, operation for operation as transformers does it
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    return logits


def supervised_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions whose next token is supervised, as flat indices into the ``[B, T]`` batch (``row * T + t``),
    row-major. ``lay_out`` computes them on the host: indexing with them lets the forward pick the supervised rows
    without a host synchronisation, which a boolean mask's indexing makes (the host waits to learn its size)."""
    rows, steps = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    return rows * labels.shape[1] + steps


def supervised_targets(labels: torch.Tensor, positions: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, targets)``: ``supervised_positions`` of ``labels`` (given, as the batch carries them, or
    computed) and the token each predicts."""
    if positions is None:
        positions = supervised_positions(labels)
    else:
        positions = positions.to(labels.device, non_blocking=True)
        # Checked on the device, without waiting for it: positions that no longer describe these labels stop the run.
        torch._assert_async((labels[:, 1:] != IGNORE_INDEX).sum() == positions.numel(),
                            "lavis_ds: the batch's supervised_positions do not match its labels")
    return positions, labels.reshape(-1)[positions + 1]


def picked(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows of ``[B, T, ...]`` ``values`` at flat ``positions``."""
    return values.reshape(-1, *values.shape[2:])[positions]


def token_logps(llm: nn.Module, inputs_embeds: torch.Tensor, layout: dict[str, torch.Tensor],
                labels: torch.Tensor, chunks: int, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability (fp32) of each supervised target, and its position (``supervised_positions``), row-major.

    Args:
        llm: The causal LM as the model holds it (a transformers model, or a peft wrapper around one: the LoRA
            layers sit inside the wrapped model's modules, so its decoder and head run them).
        inputs_embeds: ``[B, T, H]`` input embeddings (image features spliced in).
        layout: ``attention_mask`` (padded rows) or ``position_ids`` (packed rows).
        labels: ``[B, T]`` with ``IGNORE_INDEX`` where nothing is supervised.
        chunks: Head calls the supervised positions are split into (equal parts, some empty when there are fewer
            positions); 0 applies the model's own forward to every position (the full ``[B, T, V]`` logits; the path
            of families ``head_loss_supported`` rejects). A number of calls, not a size: every rank must call the
            head as many times as the others, since ZeRO-3 gathers its weight at each call (a collective), and
            ranks hold different numbers of supervised tokens.
        positions: ``supervised_positions(labels)`` as the batch carries them (None: computed here).
    """
    positions, targets = supervised_targets(labels, positions)
    inner = base_llm(llm)
    if chunks <= 0 or not head_loss_supported(inner):
        logits = llm(inputs_embeds=inputs_embeds, use_cache=False, **layout).logits
        return -F.cross_entropy(picked(logits, positions).float(), targets, reduction="none"), positions
    hidden = inner.get_decoder()(inputs_embeds=inputs_embeds, use_cache=False, **layout).last_hidden_state
    logps = [-F.cross_entropy(output_logits(inner, part).float(), goal, reduction="none")
             for part, goal in zip(picked(hidden, positions).tensor_split(chunks), targets.tensor_split(chunks))]
    return torch.cat(logps), positions


def full_logits_loss(llm: nn.Module, inputs_embeds: torch.Tensor, layout: dict[str, Any],
                     labels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The summed token loss from the model's own ``[B, T, V]`` logits: the reference path (``loss_chunks: 0``)."""
    logits = llm(inputs_embeds=inputs_embeds, use_cache=False, **layout).logits
    positions, targets = supervised_targets(labels, positions)
    # Only supervised positions are upcast to fp32 (a bf16 log-softmax over 150k classes is too coarse).
    return F.cross_entropy(picked(logits, positions).float(), targets, reduction="sum")
