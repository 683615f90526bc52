"""Training FLOPs of BLIP2-Qwen per image and per token, split by part, for the freeze switches the model was built with.

One rule covers every part and every freeze setting. A matmul of an ``m x k`` by a
``k x n`` operand costs ``2mkn`` FLOPs forward; backward costs the same again for each
operand that needs a gradient (``dA = dC Bᵀ`` and ``dB = Aᵀ dC`` are matmuls of the same
size), and autograd computes no other. An operand needs a gradient when it is a
trainable weight, or an activation with a trainable parameter upstream. So:

- a trained linear layer with trainable parameters below it: 2N + 2N (dX) + 2N (dW) = 6N
  per token, the usual rule;
- a frozen linear layer with trainable parameters below it (a frozen LLM under a trained
  projection): 2N + 2N (dX) = 4N, twice its forward, not three times;
- a frozen layer with nothing trainable below it (the frozen ViT and Q-Former of the
  MiniGPT4Qwen recipe): forward only, 2N;
- attention's ``Q Kᵀ`` and ``P V`` have two activation operands: 3x their forward
  (12·L·H·Q·T per token) whenever a gradient passes through them, frozen weights or not.

The walk below applies the rule matmul by matmul, following ``requires_grad`` as autograd
does, and reads every size from the built modules (``in_features``, ``out_features``,
patch and query counts), so it holds for the tiny and the full-size presets, LoRA
adapters and ``unfreeze_pos_embed`` alike. Elementwise work (norms, activations,
softmax, RoPE, the loss) is not counted, as in the 6N convention and in
``torch.utils.flop_counter``. These are model FLOPs: activation checkpointing's
recomputed forward is not counted (MFU, not hardware FLOPs utilisation). The trainable
token rows of a frozen LLM whose tokenizer lacked ChatML tokens (a few rows,
``lavis_ds.models.llm``) are left out. The formula is written out in docs/throughput.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from lavis_ds.models.llm import base_llm


@dataclass(frozen=True)
class Flops:
    """FLOPs of one piece of work: its forward pass, and forward plus backward as training runs it."""

    forward: float
    training: float

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.forward + other.forward, self.training + other.training)

    def __mul__(self, factor: float) -> Flops:
        return Flops(self.forward * factor, self.training * factor)


@dataclass(frozen=True)
class FlopModel:
    """FLOPs of BLIP2-Qwen per training sample, by part.

    The vision side costs the same for every image (a sample has none, one or several); the
    LLM's linear layers grow with the sequence length ``T`` and its attention with ``T²``.

    Attributes:
        vit: EVA-ViT on one image (patch embedding and blocks).
        qformer: Q-Former on one image's features (self-attention over the queries,
            cross-attention to the image tokens in every ``cross_attention_frequency``-th layer, FFN).
        projector: The Q-Former -> LLM projection of one image's queries.
        llm_per_token: The LLM's linear layers and output head, per token of the sequence.
        llm_attention: The LLM's ``Q Kᵀ`` and ``P V`` matmuls, per ``T²`` (the full square, as the
            12·L·H·Q·T convention and FlopCounterMode count it; a causal kernel skips half of it).
    """

    vit: Flops
    qformer: Flops
    projector: Flops
    llm_per_token: Flops
    llm_attention: Flops

    def llm(self, seq_len: float) -> Flops:
        """The LLM on one sequence of ``seq_len`` tokens."""
        return self.llm_per_token * seq_len + self.llm_attention * (seq_len * seq_len)

    def per_sample(self, seq_len: float, images: int = 1) -> dict[str, Flops]:
        """FLOPs of one sample with ``images`` images whose LLM sequence has ``seq_len`` tokens, by part, and their
        ``total``."""
        parts = {"vit": self.vit * images, "qformer": self.qformer * images, "projector": self.projector * images,
                 "llm": self.llm(seq_len)}
        return {**parts, "total": sum(parts.values(), Flops(0.0, 0.0))}

    def training_flops(self, images: int, tokens: int, squared_tokens: int) -> float:
        """Training FLOPs of samples holding ``images`` images in all, whose sequence lengths add up to ``tokens``
        and whose squared lengths add up to ``squared_tokens`` (what a step's counts hold, ``runners.throughput``).
        The blank image a text-only micro-batch runs (``Blip2Qwen.image_embeds``) is not useful work: not counted."""
        per_image = self.vit.training + self.qformer.training + self.projector.training
        return (images * per_image + tokens * self.llm_per_token.training
                + squared_tokens * self.llm_attention.training)


def flop_model(model: nn.Module) -> FlopModel:
    """The ``FlopModel`` of a built ``Blip2Qwen``, for the parameters that train in it now.

    Works on a model whose weights are partitioned (ZeRO-3, FSDP) or on the meta device:
    only layer sizes and ``requires_grad`` are read.
    """
    vit, qformer, projector = _Tally(), _Tally(), _Tally()
    features_grad = _vit(model.visual_encoder, vit) | _trains(model.ln_vision)
    image_tokens = _vit_tokens(model.visual_encoder)
    queries_grad = _qformer(model, image_tokens, features_grad, qformer)
    image_grad = projector.linear(model.llm_proj, _num_queries(model), queries_grad)
    linear, attention = _Tally(), _Tally()
    _llm(base_llm(model.llm_model), image_grad, linear, attention)
    return FlopModel(vit.flops(), qformer.flops(), projector.flops(), linear.flops(), attention.flops())


class _Tally:
    """Matmul FLOPs, forward and backward, by the rule in the module docstring."""

    def __init__(self) -> None:
        self.forward = self.backward = 0.0

    def matmul(self, flops: float, *needs_grad: bool) -> bool:
        """A matmul of ``flops`` forward FLOPs whose operands need gradients as given; whether its output needs one."""
        self.forward += flops
        self.backward += flops * sum(needs_grad)
        return any(needs_grad)

    def linear(self, layer: nn.Module, rows: float, input_grad: bool) -> bool:
        """A ``nn.Linear`` (or a peft LoRA layer around one) applied to ``rows`` rows; whether its output needs a
        gradient."""
        base = getattr(layer, "base_layer", layer)
        out = self.matmul(2 * rows * base.in_features * base.out_features, input_grad, base.weight.requires_grad)
        out |= base.bias is not None and base.bias.requires_grad
        if not getattr(layer, "merged", False):  # a merged adapter lives in the base weight
            for name in getattr(layer, "active_adapters", ()):
                if name in getattr(layer, "lora_A", {}):  # x -> A -> B, added to the base layer's output
                    low_rank = self.linear(layer.lora_A[name], rows, input_grad)
                    out |= self.linear(layer.lora_B[name], rows, low_rank)
        return out

    def attention(self, rows: float, kv_rows: float, width: int, q: bool, k: bool, v: bool) -> bool:
        """``softmax(Q Kᵀ) V`` for ``rows`` queries over ``kv_rows`` keys, ``width`` = heads x head dim."""
        scores = self.matmul(2 * rows * kv_rows * width, q, k)
        return self.matmul(2 * rows * kv_rows * width, scores, v)

    def flops(self) -> Flops:
        return Flops(self.forward, self.forward + self.backward)


def _trains(module: nn.Module | None, recurse: bool = True) -> bool:
    """Whether any parameter of ``module`` trains (a norm's affine weights make its output need a gradient)."""
    return module is not None and any(p.requires_grad for p in module.parameters(recurse=recurse))


def _num_queries(model: nn.Module) -> int:
    # ZeRO-3 leaves a partitioned parameter empty and keeps its real shape in ``ds_shape``.
    return getattr(model.query_tokens, "ds_shape", model.query_tokens.shape)[1]


def _vit_tokens(vit: nn.Module) -> int:
    return vit.patch_embed.num_patches + vit.num_prefix_tokens


def _vit(vit: nn.Module, tally: _Tally) -> bool:
    """EVA-ViT on one image; whether its output needs a gradient."""
    conv = vit.patch_embed.proj  # stride = kernel: one matmul per patch
    patch_pixels = conv.in_channels * math.prod(conv.kernel_size)
    # The image needs no gradient; the CLS token and position embedding train with unfreeze_pos_embed.
    x = tally.matmul(2 * vit.patch_embed.num_patches * patch_pixels * conv.out_channels, False,
                     conv.weight.requires_grad)
    x |= _trains(vit.patch_embed) | _trains(vit, recurse=False)
    tokens = _vit_tokens(vit)
    for block in vit.blocks:
        attn, mlp = block.attn, block.mlp
        qkv = tally.linear(attn.qkv, tokens, x | _trains(block.norm1)) | _trains(attn, recurse=False)  # q/v bias
        mixed = tally.attention(tokens, tokens, attn.qkv.out_features // 3, qkv, qkv, qkv)
        x |= tally.linear(attn.proj, tokens, mixed | _trains(attn.norm))
        hidden = tally.linear(mlp.fc1, tokens, x | _trains(block.norm2)) | _trains(mlp.norm)
        x |= tally.linear(mlp.fc2, tokens, hidden)
    return x


def _qformer(model: nn.Module, image_tokens: int, features_grad: bool, tally: _Tally) -> bool:
    """The Q-Former (HF ``Blip2QFormerModel``, query path only: no text input) on one image; whether its output needs
    a gradient."""
    qformer, queries = model.qformer, _num_queries(model)
    x = model.query_tokens.requires_grad | _trains(qformer.layernorm)
    for layer in qformer.encoder.layer:
        x = _qformer_attention(layer.attention, queries, queries, x, x, tally)
        if layer.has_cross_attention:  # every cross_attention_frequency-th layer, from the first
            x = _qformer_attention(layer.crossattention, queries, image_tokens, x, features_grad, tally)
        hidden = tally.linear(layer.intermediate_query.dense, queries, x)
        x |= tally.linear(layer.output_query.dense, queries, hidden) | _trains(layer.output_query.LayerNorm)
    return x


def _qformer_attention(block: nn.Module, rows: int, kv_rows: int, x: bool, kv_grad: bool, tally: _Tally) -> bool:
    """One Q-Former attention (self: ``kv_rows`` = the queries; cross: the image tokens) with its output dense
    layer and residual; whether its output needs a gradient."""
    attn = block.attention
    q = tally.linear(attn.query, rows, x)
    k, v = tally.linear(attn.key, kv_rows, kv_grad), tally.linear(attn.value, kv_rows, kv_grad)
    mixed = tally.attention(rows, kv_rows, attn.query.out_features, q, k, v)
    return x | tally.linear(block.output.dense, rows, mixed) | _trains(block.output.LayerNorm)


def _llm(llm: nn.Module, image_grad: bool, linear: _Tally, attention: _Tally) -> None:
    """The Qwen2 LLM per token (``linear``: one row) and per T² (``attention``: one query x one key)."""
    decoder = llm.model
    x = image_grad | _trains(llm.get_input_embeddings())  # the embeddings are a lookup: no matmul
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = x | _trains(layer.input_layernorm)
        q, k, v = (linear.linear(proj, 1, h) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        width = getattr(attn.q_proj, "base_layer", attn.q_proj).out_features  # query heads x head dim (GQA: K/V repeat)
        mixed = attention.attention(1, 1, width, q, k, v)
        x |= linear.linear(attn.o_proj, 1, mixed)
        h = x | _trains(layer.post_attention_layernorm)
        gated = linear.linear(mlp.gate_proj, 1, h) | linear.linear(mlp.up_proj, 1, h)
        x |= linear.linear(mlp.down_proj, 1, gated)
    head = llm.get_output_embeddings()
    # Logits for every position, as the forward computes them (the loss reads the supervised ones).
    linear.linear(getattr(head, "base", head), 1, x | _trains(decoder.norm))
