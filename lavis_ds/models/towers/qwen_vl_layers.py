"""The layers of the Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers, with attention over spans of a flat patch
sequence.

The modules and parameter names are transformers' (``modeling_qwen2_vl.py``, ``modeling_qwen2_5_vl.py``,
``modeling_qwen3_vl.py``): a Conv3d patch embedding (``patch_embed.proj``), 2-D rotary positions over (row,
column), and blocks of ``norm1``, ``attn`` (``qkv``, ``proj``), ``norm2`` and ``mlp`` (Qwen2-VL: LayerNorm and
``fc1``/``fc2``; Qwen2.5-VL: RMSNorm and SwiGLU ``gate_proj``/``up_proj``/``down_proj``; Qwen3-VL: LayerNorm and
``linear_fc1``/``linear_fc2``), so a published ``visual.*`` state loads unchanged.

Attention is block-diagonal: a patch attends to the patches of its own image frame (Qwen2.5-VL's windowed blocks:
of its own 112 px window). It is computed per span, never with an N x N mask: flash-attn's varlen kernel where it
is installed and the tensors are fp16/bf16 on a GPU, else one ``scaled_dot_product_attention`` call per run of
consecutive equal-length spans, batched as a view of the rows. Memory is linear in the patches beyond the
largest span's own attention.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


GridRows = list[tuple[int, int, int]]  # (t, h, w) patches per image or video, host integers


def grid_rows(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> GridRows:
    """A grid as host integers: rows as given, or a tensor's read once (``tolist``: on a GPU tensor a device sync,
    which is why a prepared batch carries its grid as rows, ``QwenVL.prepare_batch``). A tower's layout (positions,
    spans, windows) is host arithmetic on these."""
    rows = grid_thw.reshape(-1, 3).tolist() if torch.is_tensor(grid_thw) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


@functools.cache
def _flash_varlen():
    """flash-attn's varlen kernel, or None where flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@dataclass(frozen=True)
class Spans:
    """The spans attention runs over, from their lengths: the cumulative boundaries ``[0, l1, l1 + l2, ...]``
    (transformers' ``cu_seqlens``, for flash-attn) and the runs of consecutive equal-length spans, each of which
    one SDPA call takes as a batch, on a view of the rows (no copy). An image's frames make one run; Qwen2.5-VL's
    windows a few per row of windows (the full ones, then the one cut by the image's edge)."""

    cu_seqlens: torch.Tensor  # int32, on the patches' device
    max_len: int
    runs: tuple[tuple[int, int, int], ...]  # (first row, spans, span length)

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> "Spans":
        runs: list[list[int]] = []
        row = 0
        for length in lengths:
            if runs and runs[-1][2] == length:
                runs[-1][1] += 1
            else:
                runs.append([row, 1, length])
            row += length
        # built on the host, copied without making the host wait (a pageable copy is staged before it returns)
        cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        cu_seqlens = cu_seqlens.to(device, non_blocking=True)
        return cls(cu_seqlens, max(lengths), tuple(tuple(run) for run in runs))  # type: ignore[misc]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``softmax(q kᵀ / sqrt(d)) v`` within each span: ``[N, heads, d]`` each -> ``[N, heads, d]``."""
        flash = _flash_varlen()
        if flash is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            return flash(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_len, self.max_len)
        if len(self.runs) == 1:
            return _sdpa(*(x.view(self.runs[0][1], self.runs[0][2], *x.shape[1:]) for x in (q, k, v))).flatten(0, 1)
        out = torch.empty_like(q)
        for first, count, length in self.runs:
            rows = slice(first, first + count * length)
            out[rows] = _sdpa(*(x[rows].view(count, length, *x.shape[1:]) for x in (q, k, v))).flatten(0, 1)
        return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, L, heads, d]`` -> ``[B, L, heads, d]``, full attention within each of the B spans."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def frame_spans(grid_thw: torch.Tensor | GridRows) -> list[int]:
    """Span lengths of full attention: one per frame (``h*w`` patches), ``t`` per image or video."""
    return [h * w for t, h, w in grid_rows(grid_thw) for _ in range(t)]


def patch_positions(grid_thw: torch.Tensor | GridRows, merge_size: int) -> torch.Tensor:
    """(row, column) of every patch in the order the processor lays patches out (merge window by merge window):
    ``[total_patches, 2]`` on the host, as transformers' ``get_vision_position_ids``."""
    rows = []
    for t, h, w in grid_rows(grid_thw):
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge_size, merge_size, w // merge_size, merge_size)
        r, c = r.reshape(shape).transpose(1, 2).flatten(), c.reshape(shape).transpose(1, 2).flatten()
        rows.append(torch.stack([r, c], dim=-1).repeat(t, 1))
    return torch.cat(rows)


class VisionRotary(nn.Module):
    """2-D rotary embedding: a quarter of each head's dimensions turns with the patch row, a quarter with the
    column (then both halves again, as ``rotate_half`` pairs them)."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N, 2]`` -> ``(cos, sin)``, each ``[N, head_dim]`` float32."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [N, 2, head_dim // 4]
        angles = freqs.flatten(1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [N, heads, d]`` rotated in float32 (as transformers does), back in its own dtype."""
    xf, cos, sin = x.float(), cos[:, None], sin[:, None]
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class PatchEmbed(nn.Module):
    """``[patches, 3*t*p*p]`` -> ``[patches, width]`` by a Conv3d whose stride is its kernel (Qwen2-VL's and
    Qwen2.5-VL's without bias, Qwen3-VL's with one)."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, width: int, bias: bool = False):
        super().__init__()
        self.kernel = (in_channels, temporal_patch_size, patch_size, patch_size)
        kernel = [temporal_patch_size, patch_size, patch_size]
        self.proj = nn.Conv3d(in_channels, width, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = pixel_values.view(-1, *self.kernel).to(self.proj.weight.dtype)
        return self.proj(patches).view(-1, self.proj.out_channels)


class RMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm (``weight`` only), computed in float32 as transformers' ``Qwen2_5_VLRMSNorm``."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class VisionAttention(nn.Module):
    """Multi-head self-attention within spans, rotary positions on queries and keys."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, width * 3, bias=True)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, spans: Spans, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return self.proj(spans.attend(q, k, v).flatten(1))


class GeluMlp(nn.Module):
    """Qwen2-VL's MLP: ``fc2(act(fc1(x)))``."""

    def __init__(self, width: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, hidden), ACT2FN[act], nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LinearFcMlp(nn.Module):
    """Qwen3-VL's MLP: ``linear_fc2(act(linear_fc1(x)))`` (Qwen2-VL's computation under transformers' Qwen3-VL
    names)."""

    def __init__(self, width: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1, self.act = nn.Linear(width, hidden), ACT2FN[act]
        self.linear_fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class SwiGluMlp(nn.Module):
    """Qwen2.5-VL's MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, with biases."""

    def __init__(self, width: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.down_proj, self.act = nn.Linear(hidden, width), ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, width: int, heads: int, norm: type[nn.Module], mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = norm(width, eps=1e-6), norm(width, eps=1e-6)
        self.attn = VisionAttention(width, heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, spans: Spans, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), spans, rotary)
        return x + self.mlp(self.norm2(x))


def window_order(grid_thw: torch.Tensor | GridRows, merge_size: int, window_merged: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merge windows (2x2 patches) of each frame grouped into windows of
    ``window_merged`` x ``window_merged`` merge windows (112 px), row by row, the last row and column of windows
    cut short by the frame's edge. Returns the merge-window order (indices into the processor's order) and each
    window's length in patches, as transformers' ``get_vision_window_index`` does."""
    order, lengths, offset = [], [], 0
    unit = merge_size * merge_size
    for t, h, w in grid_rows(grid_thw):
        rows, cols = h // merge_size, w // merge_size
        index = torch.arange(t * rows * cols).view(t, rows, cols) + offset
        for frame in index:
            for top in range(0, rows, window_merged):
                for left in range(0, cols, window_merged):
                    window = frame[top:top + window_merged, left:left + window_merged].flatten()
                    order.append(window)
                    lengths.append(window.numel() * unit)
        offset += t * rows * cols
    return torch.cat(order), lengths  # on the host
