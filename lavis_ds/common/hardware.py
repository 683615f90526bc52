"""What the device can do and what this process used: peak bf16 FLOP/s by GPU name, peak memory.

The peaks are the vendors' dense bf16 tensor-core figures (no 2:4 sparsity), per GPU,
from NVIDIA's datasheets: A100 312 TFLOP/s (SXM and PCIe alike), H100 SXM 989,
H100 PCIe 756, H200 (SXM) 989. The datasheets print the sparse figure (twice these)
with a footnote; torchtitan's and Lightning's MFU use the dense ones, as here. GPUs
not in the table (H100/H200 NVL, GH200, consumer cards) get no peak: an MFU against
a guessed peak would mislead more than none.
"""
from __future__ import annotations

import re
import resource
import sys

import torch

# (pattern in torch.cuda.get_device_name(), the GPU it means, dense bf16 TFLOP/s); the first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"\bA100\b", "A100", 312.0),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 756.0),  # "NVIDIA H100 PCIe"
    (r"\bH100\b(?!.*\b(?:PCIe|NVL)\b)", "H100 SXM", 989.0),  # "NVIDIA H100 80GB HBM3"
    (r"\bH200\b(?!.*\bNVL\b)", "H200", 989.0),  # "NVIDIA H200"
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak TFLOP/s of the GPU named ``device_name`` (as ``torch.cuda.get_device_name``
    gives it), or None if the table does not know it."""
    for pattern, _, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops
    return None


def device_name() -> str:
    """This process's compute device, in words: the current CUDA GPU's name, else ``"CPU"``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() and torch.cuda.is_initialized() else "CPU"


def peak_memory_bytes() -> int:
    """The most memory this process has held: CUDA memory allocated by torch on the current GPU if CUDA is in
    use, else the process's peak resident set size (which includes the Python interpreter and libraries)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes
