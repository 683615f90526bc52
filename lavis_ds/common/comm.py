"""Every collective lavis_ds itself issues: one control group, CPU tensors, made once at start-up.

Two kinds of traffic cross processes. The engines' data plane (gradients, parameter shards)
runs on the default process group: NCCL on GPUs, gloo on CPUs; DeepSpeed and FSDP own it.
lavis_ds's own traffic is control: the stop/fault agreement of every step, the step's
losses, evaluation sums, gathered predictions and error messages, "did process 0 build the
model", barriers around checkpoints. It all goes through this module, on one gloo group
created beside the default group as soon as that exists (:func:`start`).

Why a side group rather than tensors on the engine's device:
- NCCL refuses CPU tensors (``No backend type associated with device type cpu``), and most
  control values are born on the host: a flag set by a signal handler, a message, a count
  read from a collated batch. On a side group they stay there; nothing is copied to the GPU
  just to be reduced and copied back.
- Object collectives (messages, predictions) pickle into CPU tensors; on NCCL torch would
  stage them through the current device, which must then be set right on every path.
- The same calls work before an engine exists (start-up checks), without a GPU (export,
  batch inference) and on every engine, so no caller asks which backend is running.
The price is a few bytes over TCP per optimizer step (the losses once per step, not per
micro-batch: see ``losses.LossCheck``) and one device-to-host copy of the step's
losses, which logging needs anyway.

Every function also works without a process group (one process, nothing to agree on), and
issues its collective on a one-process group too, so a single-GPU run takes the same path as
many. ``LAVIS_DS_NCCL_STANDIN=1`` starts the default group as gloo bound to ``cuda`` only: on a
CPU machine it refuses CPU tensors exactly as NCCL does, which is how the tests prove that
no control collective reaches the default group.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as torch_dist

STANDIN_ENV = "LAVIS_DS_NCCL_STANDIN"
_control: Any = None  # the gloo side group, once started


def default_backend() -> str:
    """The default group's backend: NCCL on GPUs, gloo on CPUs, gloo bound to cuda as the NCCL stand-in."""
    if os.environ.get(STANDIN_ENV) == "1":
        return "cuda:gloo"
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str | None = None) -> None:
    """Start the default group from the launcher's variables (if nobody did yet), then the control group."""
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend or default_backend())
    start()


def start() -> None:
    """Create the control group once, on every process (collective: right after the default group starts)."""
    global _control
    if torch_dist.is_initialized() and _control is None:
        _control = torch_dist.new_group(backend="gloo")


def stop() -> None:
    """Forget the control group (the default group is being destroyed)."""
    global _control
    _control = None


def active() -> bool:
    """Whether there are processes to talk to (a process group, of any size)."""
    return torch_dist.is_initialized()


def _group():
    if _control is None:
        start()  # a process group started by code that did not go through init_process_group (a library)
    return _control


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced over every process (``op``: sum or max), as a new CPU tensor.

    A tensor on a GPU is copied to the host once here: the one synchronisation the caller pays.
    """
    return start_all_reduce(tensor, op)()


def start_all_reduce(tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
    """``all_reduce`` started now and collected later: the returned function waits for it and returns the reduced
    CPU tensor. The reduction runs on the control group's own thread, so the caller's work in between (a backward)
    hides its latency."""
    reduced = tensor.detach().to("cpu", copy=True)
    if not active():
        return lambda: reduced
    reduce_op = {"sum": torch_dist.ReduceOp.SUM, "max": torch_dist.ReduceOp.MAX}[op]
    work = torch_dist.all_reduce(reduced, op=reduce_op, group=_group(), async_op=True)

    def collect() -> torch.Tensor:
        work.wait()
        return reduced
    return collect


def all_gather_object(obj: Any) -> list:
    """``obj`` of every process, in rank order (a list of one without a process group)."""
    if not active():
        return [obj]
    gathered = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, obj, group=_group())
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Process ``src``'s ``obj``, on every process."""
    if not active():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src, group=_group())
    return box[0]


def barrier() -> None:
    """Wait until every process is here."""
    if active():
        torch_dist.barrier(group=_group())


def default_group_barrier() -> None:
    """A barrier on the default group, where a library's own collectives run (lmms-eval's): for a process that left
    that library's code early to meet the barrier the library keeps the other processes waiting at."""
    if active():
        torch_dist.barrier()


def destroy() -> None:
    """End the control group and the default group (a process that started them and goes on without them)."""
    if active():
        stop()
        torch_dist.destroy_process_group()
