"""The process's GPU and its numerics: bound before anything touches CUDA, checked once every process runs.

Under torchrun, the ``deepspeed`` launcher or plain ``python`` each process trains on the GPU
its local rank names. ``torch.cuda.set_device`` must come before the first CUDA allocation:
otherwise every process first creates a context on GPU 0 (hundreds of MB each, and NCCL later
finds two ranks on one device). TF32 and the deterministic mode are settings of the whole
process, made once from ``run.tf32`` and ``run.deterministic`` before any kernel runs.
"""
from __future__ import annotations

import os
import socket

import torch

from lavis_ds.common import comm
from lavis_ds.common.errors import InputError

# cuBLAS reuses its workspace deterministically only with this configuration (torch's reproducibility notes);
# it must be in the environment before the first cuBLAS handle exists.
CUBLAS_DETERMINISTIC = ":4096:8"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def bind_local_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` made the current device (on a GPU machine), else the CPU.

    A launcher that starts more processes on a node than it has visible GPUs is named here,
    before NCCL would find two ranks on one GPU ("Duplicate GPU detected").
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count, rank = torch.cuda.device_count(), local_rank()
    if rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise InputError(
            f"local rank {rank} has no GPU of its own: this node shows {count} GPU(s)"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + "; start at most one process per GPU (torchrun --nproc_per_node, deepspeed --num_gpus)")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def configure_numerics(tf32: bool, deterministic: bool) -> None:
    """TF32 matmuls (``run.tf32``) and the deterministic mode (``run.deterministic``), for this process.

    Deterministic mode makes a GPU run repeat bit for bit (so exact resumption holds there too):
    cuBLAS's fixed workspace, cuDNN without autotuning, and torch's deterministic kernels; an op
    that has none then raises instead of running (see :func:`deterministic_error`).
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False  # autotuning picks kernels by timing: another run, another choice
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def deterministic_error(error: RuntimeError) -> InputError | None:
    """The ``lavis_ds:`` error for an op without a deterministic implementation (None for other errors)."""
    text = str(error)
    if "does not have a deterministic implementation" not in text:
        return None
    first = text.strip().splitlines()[0]
    return InputError(
        f"run.deterministic: an operation of this run has no deterministic implementation on "
        f"{'this GPU' if torch.cuda.is_available() else 'this device'} ({first}). Set run.deterministic=false, or "
        "use an implementation that has one (e.g. model.attn_implementation: sdpa or eager instead of "
        "flash_attention_2)")


def check_one_gpu_per_process() -> None:
    """Collective: an error naming the processes that share a GPU (two ranks of one host on one device).

    ``CUDA_VISIBLE_DEVICES`` set alike for every process with a launcher that does not give each its
    own local rank, or two jobs' ranks on one GPU, end here instead of in NCCL.
    """
    where = None
    if torch.cuda.is_available():
        where = (socket.gethostname(), str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid))
    seen: dict[tuple, list[int]] = {}
    for rank, place in enumerate(comm.all_gather_object(where)):
        if place is not None:
            seen.setdefault(place, []).append(rank)
    shared = [(place, ranks) for place, ranks in seen.items() if len(ranks) > 1]
    if shared:
        (host, uuid), ranks = shared[0]
        raise InputError(
            f"ranks {', '.join(map(str, ranks))} share one GPU (host {host}, GPU {uuid}); each process needs its own: "
            "give every process its own LOCAL_RANK (torchrun and the deepspeed launcher do), and do not set "
            "CUDA_VISIBLE_DEVICES to one GPU for several processes")
