"""Training FLOPs of a vision-LLM per image and per token, by part (tower, connector, LLM), for the freeze switches
the model was built with.

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
  MiniGPT4Qwen recipe): forward only, 2N; so is a layer whose output autograd never reaches
  (a CLIP tower's layers past the selected hidden state, SigLIP's pooling head);
- attention's ``Q Kᵀ`` and ``P V`` have two activation operands: 3x their forward
  (12·L·H·Q·T per token) whenever a gradient passes through them, frozen weights or not.

Each part walks itself by this rule (``VisionTower.flops``, ``Connector.flops``; the walks of
EVA-ViT, the CLIP/SigLIP encoders and the Q-Former are below), the LLM's walk is here, and
``compose`` puts them together (``VisionLLM.flop_model``). The walks apply the rule matmul by
matmul, following ``requires_grad`` as autograd does, and read every size from the built
modules (``in_features``, ``out_features``, patch and query counts), so they hold for the tiny
and the full-size presets, LoRA adapters and ``unfreeze_pos_embed`` alike. Elementwise work
(norms, activations, softmax, RoPE, the loss) is not counted, as in the 6N convention and in
``torch.utils.flop_counter``. The LM head runs where the loss reads it: at the supervised
positions (``lavis_ds.models.lm_loss``), or at every position on the full-logits path. These
are model FLOPs: activation checkpointing's recomputed forward is not counted (MFU, not hardware FLOPs utilisation). The trainable
token rows of a frozen LLM whose tokenizer lacked ChatML tokens (a few rows,
``lavis_ds.models.llm``) are left out. The formula is written out in docs/throughput.md.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

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


ZERO = Flops(0.0, 0.0)


@dataclass(frozen=True)
class FlopModel:
    """FLOPs of a vision-LLM per training sample, by part: its vision tower, its connector and its LLM.

    The image path costs the same for every image (a sample has none, one or several), or, for a tower that takes
    each image at its own size (Qwen-VL), what ``image_path_of_size`` gives for that image; a connector that reads
    each image's instruction (InstructBLIP's Q-Former) adds a cost per instruction token and, through its
    self-attention over queries and text together, per squared instruction token. The LLM's linear layers grow
    with the sequence length ``T``, its attention with ``T²``, and its output head with the positions it runs at.

    Attributes:
        tower: The vision tower on one image.
        connector: The connector on one image's tower features (no instruction text).
        llm_per_token: The LLM decoder's linear layers, per token of the sequence.
        llm_attention: The LLM's ``Q Kᵀ`` and ``P V`` matmuls, per ``T²`` (the full square, as the
            12·L·H·Q·T convention and FlopCounterMode count it; a causal kernel skips half of it).
        head: The LLM's output head at one position.
        head_at_every_position: Whether the head runs at every position (the LLM's own full-logits forward:
            ``loss_chunks: 0``, or a family the chunked path does not reproduce) or only at the supervised
            ones (``lavis_ds.models.lm_loss``).
        connector_per_text_token: The connector's extra cost per instruction token of an image.
        connector_text_attention: Its extra cost per squared instruction token of an image.
        image_path_of_size: Tower and connector FLOPs of one image of a given size (its grid row, as
            ``lavis_ds.models.image_tokens.image_sizes`` gives it), for a tower whose cost depends on the image's
            size; ``tower`` and ``connector`` are then ZERO and each image is counted by its size.
    """

    tower: Flops
    connector: Flops
    llm_per_token: Flops
    llm_attention: Flops
    head: Flops
    head_at_every_position: bool = False
    connector_per_text_token: Flops = ZERO
    connector_text_attention: Flops = ZERO
    image_path_of_size: Callable[[tuple[int, ...]], tuple[Flops, Flops]] | None = None

    def llm(self, seq_len: float) -> Flops:
        """The LLM's decoder on one sequence of ``seq_len`` tokens (the head apart)."""
        return self.llm_per_token * seq_len + self.llm_attention * (seq_len * seq_len)

    def image_path(self, text_tokens: float = 0) -> Flops:
        """Tower and connector on one image whose instruction has ``text_tokens`` tokens (connectors that read
        none ignore it); ZERO for a model whose images cost by their size (``image_path_of_size``)."""
        return (self.tower + self.connector + self.connector_per_text_token * text_tokens
                + self.connector_text_attention * (text_tokens * text_tokens))

    def per_sample(self, seq_len: float, supervised: float, images: int = 1, text_tokens: float = 0,
                   image_sizes: Sequence[tuple[int, ...]] = ()) -> dict[str, Flops]:
        """FLOPs of one sample with ``images`` images whose LLM sequence has ``seq_len`` tokens, ``supervised`` of them
        supervised, by part (``tower``, ``connector``, ``llm``, ``head``), and their ``total``. ``text_tokens``:
        the instruction tokens of each image, for connectors that read them. ``image_sizes``: each image's size,
        for a model whose image path costs by size (``image_path_of_size``)."""
        connector = (self.connector + self.connector_per_text_token * text_tokens
                     + self.connector_text_attention * (text_tokens * text_tokens))
        sized_tower, sized_connector = self._sized(Counter(map(tuple, image_sizes)))
        parts = {"tower": self.tower * images + sized_tower, "connector": connector * images + sized_connector,
                 "llm": self.llm(seq_len), "head": self.head * (seq_len if self.head_at_every_position else supervised)}
        return {**parts, "total": sum(parts.values(), ZERO)}

    def _sized(self, image_sizes: Mapping[tuple[int, ...], int]) -> tuple[Flops, Flops]:
        """Tower and connector FLOPs of images counted by size (``{size: images}``); ZERO for a model whose
        images cost the same (its ``tower`` and ``connector`` count them)."""
        tower = connector = ZERO
        if self.image_path_of_size is not None:
            for size, count in image_sizes.items():
                one_tower, one_connector = self.image_path_of_size(tuple(size))
                tower, connector = tower + one_tower * count, connector + one_connector * count
        return tower, connector

    def training_flops(self, images: int, tokens: int, squared_tokens: int, supervised: int,
                       text_tokens: int = 0, squared_text_tokens: int = 0,
                       image_sizes: Mapping[tuple[int, ...], int] | None = None) -> float:
        """Training FLOPs of samples holding ``images`` images in all (``image_sizes``: how many of each size),
        whose sequence lengths add up to ``tokens`` and whose squared lengths add up to ``squared_tokens``, with
        ``supervised`` supervised tokens, and whose images' instructions have ``text_tokens`` tokens (squares:
        ``squared_text_tokens``): what a step's counts hold (``runners.throughput``). The blank image a text-only
        micro-batch runs (``ImagePath.features``) is not useful work: not counted."""
        head_positions = tokens if self.head_at_every_position else supervised
        sized_tower, sized_connector = self._sized(image_sizes or {})
        return (images * (self.tower.training + self.connector.training)
                + sized_tower.training + sized_connector.training
                + text_tokens * self.connector_per_text_token.training
                + squared_text_tokens * self.connector_text_attention.training
                + tokens * self.llm_per_token.training + squared_tokens * self.llm_attention.training
                + head_positions * self.head.training)


def compose(tower: Flops, connector: Callable[[int], Flops], image_grad: bool, llm: nn.Module,
            head_at_every_position: bool) -> FlopModel:
    """The ``FlopModel`` of a tower, a connector and an LLM.

    Args:
        tower: The tower's FLOPs per image.
        connector: The connector's FLOPs per image given its instruction tokens per image (a quadratic in them:
            three values fix it; connectors that read no instruction give the same for any).
        image_grad: Whether the connector's output needs a gradient (a trainable parameter in the image path).
        llm: The LLM as the model holds it (a transformers causal LM, or a peft wrapper around one).
        head_at_every_position: See ``FlopModel``.
    """
    c0, c1, c2 = connector(0), connector(1), connector(2)
    # c(L) = c0 + a L + b L², so c1 - c0 = a + b and c2 - c0 = 2a + 4b.
    squared = (c2 + c1 * -2 + c0) * 0.5
    linear_in_text = c1 + c0 * -1 + squared * -1
    decoder, attention, head = Tally(), Tally(), Tally()
    _llm(base_llm(llm), image_grad, decoder, attention, head)
    return FlopModel(tower, c0, decoder.flops(), attention.flops(), head.flops(), head_at_every_position,
                     linear_in_text, squared)


class Tally:
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


def trains(module: nn.Module | None, recurse: bool = True) -> bool:
    """Whether any parameter of ``module`` trains (a norm's affine weights make its output need a gradient)."""
    return module is not None and any(p.requires_grad for p in module.parameters(recurse=recurse))


def shape_of(parameter: nn.Parameter) -> tuple[int, ...]:
    """A parameter's real shape, also when ZeRO-3 has partitioned it (empty, the shape kept in ``ds_shape``)."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))


def patch_embedding(conv: nn.Conv2d, patches: int, tally: Tally) -> bool:
    """A ViT's patch embedding (a convolution whose stride is its kernel: one matmul per patch) on an image, which
    needs no gradient; whether its output needs one."""
    patch_pixels = conv.in_channels * math.prod(conv.kernel_size)
    out = tally.matmul(2 * patches * patch_pixels * conv.out_channels, False, conv.weight.requires_grad)
    return out | (conv.bias is not None and conv.bias.requires_grad)


def eva_vit_tokens(vit: nn.Module) -> int:
    """Tokens of an ``EvaViT`` per image: its patches and CLS."""
    return vit.patch_embed.num_patches + vit.num_prefix_tokens


def eva_vit(vit: nn.Module, tally: Tally) -> bool:
    """EVA-ViT (``lavis_ds.models.eva_vit.EvaViT``) on one image; whether its output needs a gradient."""
    # The CLS token and position embedding train with unfreeze_pos_embed.
    x = patch_embedding(vit.patch_embed.proj, vit.patch_embed.num_patches, tally)
    x |= trains(vit.patch_embed) | trains(vit, recurse=False)
    tokens = eva_vit_tokens(vit)
    for block in vit.blocks:
        attn, mlp = block.attn, block.mlp
        qkv = tally.linear(attn.qkv, tokens, x | trains(block.norm1)) | trains(attn, recurse=False)  # q/v bias
        mixed = tally.attention(tokens, tokens, attn.qkv.out_features // 3, qkv, qkv, qkv)
        x |= tally.linear(attn.proj, tokens, mixed | trains(attn.norm))
        hidden = tally.linear(mlp.fc1, tokens, x | trains(block.norm2)) | trains(mlp.norm)
        x |= tally.linear(mlp.fc2, tokens, hidden)
    return x


def hf_vision_encoder(embeddings: nn.Module, pre_norm: nn.Module | None, layers: list[nn.Module], used: int,
                      tokens: int, tally: Tally, forward_only: Tally) -> bool:
    """A transformers CLIP / SigLIP vision encoder on one image, of which the first ``used`` layers feed the
    features; the rest go to ``forward_only`` (they run, but autograd never reaches them). Whether the features
    need a gradient."""
    conv = embeddings.patch_embedding
    x = patch_embedding(conv, embeddings.num_patches, tally) | trains(embeddings, recurse=False)
    x |= trains(embeddings.position_embedding) | trains(pre_norm)  # CLIP's pre_layrnorm
    for index, layer in enumerate(layers):
        if index == used:
            features_grad, x, tally = x, False, forward_only
        attn, mlp = layer.self_attn, layer.mlp
        h = x | trains(layer.layer_norm1)
        q, k, v = (tally.linear(proj, tokens, h) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        mixed = tally.attention(tokens, tokens, attn.q_proj.out_features, q, k, v)
        x |= tally.linear(attn.out_proj, tokens, mixed)
        hidden = tally.linear(mlp.fc1, tokens, x | trains(layer.layer_norm2))
        x |= tally.linear(mlp.fc2, tokens, hidden)
    return x if used >= len(layers) else features_grad


def attention_pooling(head: nn.Module, tokens: int, tally: Tally) -> None:
    """SigLIP's attention-pooling head (one probe query over the tokens, then an MLP) on one image: it runs in the
    tower's forward but feeds no feature, so forward only."""
    width = head.probe.shape[-1]
    tally.matmul(2 * width * width, False)  # the probe's query projection
    tally.matmul(2 * tokens * width * 2 * width, False)  # keys and values
    tally.attention(1, tokens, width, False, False, False)
    tally.linear(head.attention.out_proj, 1, False)
    tally.linear(head.mlp.fc1, 1, False)
    tally.linear(head.mlp.fc2, 1, False)


def qformer(model: nn.Module, query_tokens: nn.Parameter, ln_vision: nn.Module, llm_proj: nn.Module,
            image_tokens: int, features_grad: bool, tally: Tally, text_tokens: int = 0) -> bool:
    """``ln_vision``, a Q-Former (transformers' BLIP-2 or InstructBLIP one) and its projection on one image's
    ``image_tokens`` tower features; whether the projected queries need a gradient.

    ``text_tokens``: instruction tokens beside the queries (InstructBLIP): they share the self-attention and the
    layers' linear maps (their own feed-forward) but not the cross-attention; only the queries are projected."""
    features_grad |= trains(ln_vision)
    queries = shape_of(query_tokens)[1]
    rows = queries + text_tokens
    # BLIP-2's Q-Former normalises the queries with its own `layernorm`; InstructBLIP's `embeddings` embed the text
    # (word and position embeddings) and normalise queries and text with their `layernorm`. A row's gradient need
    # is tracked per kind: the self-attention mixes queries and text, the cross-attention reaches the queries only.
    norm = getattr(model, "layernorm", None) or model.embeddings.layernorm
    query_grad = query_tokens.requires_grad | trains(norm)
    text_grad = bool(text_tokens) and trains(getattr(model, "embeddings", None))
    for layer in model.encoder.layer:
        query_grad = text_grad = _qformer_attention(layer.attention, rows, rows, query_grad | text_grad,
                                                    query_grad | text_grad, tally)
        if layer.has_cross_attention:  # every cross_attention_frequency-th layer, from the first
            query_grad = _qformer_attention(layer.crossattention, queries, image_tokens, query_grad, features_grad,
                                            tally)
        hidden = tally.linear(layer.intermediate_query.dense, queries, query_grad)
        query_grad |= tally.linear(layer.output_query.dense, queries, hidden) | trains(layer.output_query.LayerNorm)
        if text_tokens:  # the text rows' own feed-forward
            hidden = tally.linear(layer.intermediate.dense, text_tokens, text_grad)
            text_grad |= tally.linear(layer.output.dense, text_tokens, hidden) | trains(layer.output.LayerNorm)
    return tally.linear(llm_proj, queries, query_grad)


def _qformer_attention(block: nn.Module, rows: int, kv_rows: int, x: bool, kv_grad: bool, tally: Tally) -> bool:
    """One Q-Former attention (self: ``kv_rows`` = its rows; cross: the image tokens) with its output dense
    layer and residual; whether its output needs a gradient."""
    attn = block.attention
    q = tally.linear(attn.query, rows, x)
    k, v = tally.linear(attn.key, kv_rows, kv_grad), tally.linear(attn.value, kv_rows, kv_grad)
    mixed = tally.attention(rows, kv_rows, attn.query.out_features, q, k, v)
    return x | tally.linear(block.output.dense, rows, mixed) | trains(block.output.LayerNorm)


def _llm(llm: nn.Module, image_grad: bool, linear: Tally, attention: Tally, head: Tally) -> None:
    """The causal LM per token (``linear``: one row), per T² (``attention``: one query x one key) and its output
    head at one position (``head``)."""
    decoder = llm.model
    x = image_grad | trains(llm.get_input_embeddings())  # the embeddings are a lookup: no matmul
    for layer in decoder.layers:
        mlp = layer.mlp
        h = x | trains(layer.input_layernorm)
        if hasattr(layer, "linear_attn"):  # Qwen3.5's Gated-DeltaNet layers
            x |= gated_delta_net(layer.linear_attn, h, linear)
        else:
            attn = layer.self_attn
            q, k, v = (linear.linear(proj, 1, h) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            # query heads x head dim (GQA: K/V repeat); o_proj's input, as Qwen3.5's q_proj also makes an output gate
            width = getattr(attn.o_proj, "base_layer", attn.o_proj).in_features
            mixed = attention.attention(1, 1, width, q, k, v)
            x |= linear.linear(attn.o_proj, 1, mixed)
        h = x | trains(layer.post_attention_layernorm)
        gated = linear.linear(mlp.gate_proj, 1, h) | linear.linear(mlp.up_proj, 1, h)
        x |= linear.linear(mlp.down_proj, 1, gated)
    output = llm.get_output_embeddings()
    # A TokenRowsHead's trained rows (a few ChatML tokens) are left out, as the module docstring says.
    head.linear(getattr(output, "base", output), 1, x | trains(decoder.norm))


DELTA_RULE_CHUNK = 64  # the chunk size of transformers' chunked delta rule and of flash-linear-attention's kernel


def gated_delta_net(layer: nn.Module, h: bool, tally: Tally) -> bool:
    """One Gated-DeltaNet layer (Qwen3.5's linear attention) per token; whether its output needs a gradient.

    Its projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``out_proj``) are linear layers.
    The causal depthwise convolution over ``K`` = ``linear_conv_kernel_dim`` tokens costs ``2·K·C`` per token (``C``
    the convolved q, k and v channels). The chunked delta rule (chunks of ``c`` = 64 tokens, each of the ``H`` value
    heads with key width ``dk`` and value width ``dv``) runs per chunk ``K_β Kᵀ`` and ``Q Kᵀ`` (``2·c²·dk`` each),
    ``(attention within the chunk) V`` (``2·c²·dv``) and three products with the ``dk x dv`` state (read twice,
    updated once: ``2·c·dk·dv`` each): per token ``H·(4·c·dk + 2·c·dv + 6·dk·dv)``, linear in the sequence length
    (no ``T²`` term). Its matmuls multiply activations, so training costs 3x their forward whenever a gradient
    passes, as attention's do. Not counted, as elsewhere: the triangular solves (not matmuls), the gates, norms and
    decays (elementwise), and the padding of a sequence to whole chunks.
    """
    qkv = tally.linear(layer.in_proj_qkv, 1, h)
    gates = tally.linear(layer.in_proj_z, 1, h) | tally.linear(layer.in_proj_b, 1, h)
    gates |= tally.linear(layer.in_proj_a, 1, h) | trains(layer, recurse=False)  # A_log, dt_bias
    conv = layer.conv1d
    mixed = tally.matmul(2 * conv.kernel_size[0] * conv.out_channels, qkv, conv.weight.requires_grad)
    heads, dk, dv, chunk = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, DELTA_RULE_CHUNK
    rule = mixed | gates
    tally.matmul(heads * (4 * chunk * dk + 2 * chunk * dv + 6 * dk * dv), rule, rule)
    return tally.linear(layer.out_proj, 1, rule | trains(layer.norm))
