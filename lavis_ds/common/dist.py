"""Process-group set-up that works alone, under torchrun and under the deepspeed launcher."""
from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import socket
import sys
import weakref

import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_defaults() -> None:
    """Fill in the env vars a launcher would set, so a plain `python train.py` works.

    deepspeed.init_distributed() without them falls back to MPI discovery and
    fails, init_process_group waits for them; torchrun and the deepspeed launcher set them all, so this is a no-op there.
    """
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # A free port rather than a fixed one: two single-process runs may share a machine.
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def init_distributed() -> None:
    """Initialise torch.distributed from the launcher's variables (gloo on CPU, nccl on GPU) and the control
    group beside it (``comm``). The process's GPU is bound first (``device.bind_local_device``).

    An engine that needs its own start (DeepSpeed) does it in its engine class's ``setup.init_process_group``.
    """
    from lavis_ds.common import comm
    from lavis_ds.common.device import bind_local_device

    set_single_process_defaults()
    bind_local_device()
    comm.init_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_main_process() -> bool:
    return rank() == 0


def exit_now(code: int) -> None:
    """End a finished process without Python's interpreter teardown.

    Once torch, transformers and DeepSpeed are loaded, finalising the interpreter (freeing every
    module, then C++ static destructors) takes ~3 s per process on 2 cores, and a destructor that
    meets a still-joinable C++ thread occasionally aborts a run that had succeeded ("terminate
    called without an active exception"). Everything a run writes is closed by then; the atexit
    handlers (logging, multiprocessing children) still run, the streams are flushed.

    Daemonic children still running (the DataLoader workers of a loop that stopped on an error) are
    killed first: multiprocessing's exit handler would SIGTERM them, which they ignore
    (runners.faults.ignore_stop_signals), then wait for them forever. (Without the DataLoader's
    SIGCHLD handler, which would report their end as a worker failure.)
    """
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in workers:
            child.kill()
    _drop_torch_library_finalizers()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _drop_torch_library_finalizers() -> None:
    """At exit torch unregisters its custom-op libraries one by one (weakref finalizers, ~0.13 s of CPU per
    process on 2 cores), which a process that ends now does not need; other finalizers (temporary folders) run."""
    import torch.library

    unregister = getattr(torch.library, "_del_library", None)
    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if getattr(info, "func", None) is unregister:
            finalizer.detach()


def full_shape(param) -> tuple[int, ...]:
    """A parameter's shape as the model defines it, also when DeepSpeed ZeRO-3 partitioned it (the tensor is
    then empty outside a gather and ``ds_shape`` keeps the shape)."""
    return tuple(getattr(param, "ds_shape", param.shape))
