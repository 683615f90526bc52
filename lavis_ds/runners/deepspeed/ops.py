"""DeepSpeed's C++ CPU ops: compiled once per Python environment, and said so while it happens.

DeepSpeed JIT-compiles its CPU ops (the Adam kernel, the shared-memory collectives) the first
time a run needs them: minutes on a small machine, with nothing printed, so it looks like a
hang. The ops a run needs are built before the process group starts, with a line saying what
and how long, into the environment's own folder (``lavis_ds.common.extensions``).

    python -m lavis_ds.runners.deepspeed.ops          # build them all now (e.g. right after install)

On a GPU machine DeepSpeed JIT-builds its CUDA ops (FusedAdam; DeepSpeedCPUAdam for offload) with the
CUDA toolkit's compiler. Where none is installed (a pip-only environment: torch brings the CUDA
runtime, not nvcc), FusedAdam's build would stop the run with ``CUDA_HOME does not exist``:
:func:`adam_for_this_machine` steps torch's fused AdamW instead (the same AdamW math, one line
says so), and :func:`gpu_problems` names what still needs the compiler (optimizer offload).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from lavis_ds.common.extensions import configure_build_environment
from lavis_ds.runners.deepspeed.library import load_deepspeed

# DeepSpeed op builder class -> what it is for, as printed while it compiles.
OPS = {
    "ShareMemCommBuilder": "shared-memory collectives (CPU)",
    "FusedAdamBuilder": "Adam kernel (CPU)",
    "CPUAdamBuilder": "ZeRO-Offload Adam (DeepSpeedCPUAdam)",
}
# Measured here (2 cores, other work running): fused_adam + shm comm 4 min, cpu_adam 3 min.
TYPICAL_MINUTES = "1-3 minutes each on 2 cores"


def ops_for(ds_config: dict) -> list[str]:
    """The op builders a run with this DeepSpeed config loads on a CPU-only machine."""
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    return ["ShareMemCommBuilder", "CPUAdamBuilder" if offload else "FusedAdamBuilder"]


def cuda_compiler() -> Path | None:
    """nvcc where DeepSpeed's op builders look for it (``$CUDA_HOME/bin/nvcc``, as torch finds CUDA_HOME), or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    return nvcc if nvcc is not None and nvcc.is_file() else None


def prebuilt(op_name: str) -> bool:
    """Whether the installed DeepSpeed ships ``op_name`` compiled (``DS_BUILD_...=1 pip install deepspeed``)."""
    load_deepspeed()
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get(op_name))


def _offloads_optimizer(ds_config: dict) -> bool:
    zero = ds_config.get("zero_optimization") or {}
    return (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)


def adam_for_this_machine(ds_config: dict, on_gpu: bool) -> tuple[dict, str | None]:
    """``ds_config`` with torch's fused AdamW in place of DeepSpeed's FusedAdam on a GPU machine that can neither
    load a prebuilt FusedAdam nor compile one, and the line that says so (None: nothing changed)."""
    optimizer = ds_config.get("optimizer") or {}
    if (not on_gpu or _offloads_optimizer(ds_config) or str(optimizer.get("type", "")).lower() not in ("adam", "adamw")
            or prebuilt("fused_adam") or cuda_compiler() is not None or "torch_adam" in optimizer.get("params", {})):
        return ds_config, None
    params = {**optimizer.get("params", {}), "torch_adam": True, "fused": True}
    note = ("lavis_ds: no CUDA compiler (nvcc under CUDA_HOME) to build DeepSpeed's FusedAdam: stepping torch's fused "
            "AdamW instead (the same update); install the CUDA toolkit or a DeepSpeed built with DS_BUILD_FUSED_ADAM=1 "
            "to use DeepSpeed's")
    return {**ds_config, "optimizer": {**optimizer, "params": params}}, note


def gpu_problems(ds_config: dict, on_gpu: bool,
                 where: str = "run.deepspeed_config.zero_optimization.offload_optimizer") -> list[str]:
    """What this DeepSpeed config cannot run on this GPU machine (empty on a CPU machine); ``where``: the key that
    asked for optimizer offload."""
    if on_gpu and _offloads_optimizer(ds_config) and not prebuilt("cpu_adam") and cuda_compiler() is None:
        return [f"{where}: optimizer offload steps DeepSpeed's "
                "CPU Adam, which is compiled against the CUDA toolkit on a GPU machine, and this machine has no CUDA "
                "compiler (nvcc under CUDA_HOME). Install the CUDA toolkit (and set CUDA_HOME), or a DeepSpeed built "
                "with DS_BUILD_CPU_ADAM=1, or train without offload_optimizer"]
    return []


# An entry of TORCH_CUDA_ARCH_LIST: "9.0", "8.6+PTX", or an arch-specific one ("9.0a", "10.0f").
ARCH_ENTRY = re.compile(r"^(\d+\.\d+)([a-z]*)(\+PTX)?$")


def arch_list_deepspeed_reads(value: str) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT op builder can read it, or None where it reads it as it is.

    DeepSpeed sorts the entries as integers, so an arch-specific entry ("9.0a", which CUDA images for Hopper set)
    stops every op build with ``invalid literal for int()``; torch reads them. Such an entry becomes the plain
    arch ("9.0": DeepSpeed's kernels use no arch-specific instructions), a named one ("Hopper") is left out, and
    when nothing is left the result is "" (unset it: DeepSpeed then builds for the GPUs it finds)."""
    entries = value.replace(" ", ";").split(";")
    entries = [entry.strip() for entry in entries if entry.strip()]
    matches = [ARCH_ENTRY.match(entry) for entry in entries]
    if all(m is not None and not m.group(2) for m in matches):
        return None
    readable = [m.group(1) + (m.group(3) or "") for m in matches if m is not None]
    return ";".join(dict.fromkeys(readable))


def make_arch_list_readable(announce: bool) -> None:
    """Rewrite this process's ``TORCH_CUDA_ARCH_LIST`` where DeepSpeed's op builder cannot read it
    (:func:`arch_list_deepspeed_reads`), saying so once."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    readable = arch_list_deepspeed_reads(value) if value else None
    if readable is None:
        return
    if readable:
        os.environ["TORCH_CUDA_ARCH_LIST"] = readable
    else:
        del os.environ["TORCH_CUDA_ARCH_LIST"]
    if announce:
        print(f"lavis_ds: TORCH_CUDA_ARCH_LIST={value!r} has entries DeepSpeed's op builder cannot read (it reads "
              f"numbered arches such as '9.0' or '8.6+PTX'); its ops are built for "
              f"{repr(readable) if readable else 'the GPUs it finds'} instead", flush=True)


def ensure_built(builder_names: list[str], announce: bool = True) -> None:
    """Compile (or just load) the named ops, saying so before any that has not been built yet.

    Every process may call this: torch's file lock lets one compile while the others wait.
    On a machine with a GPU accelerator DeepSpeed builds other ops its own way: nothing to do.
    """
    load_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    folder = configure_build_environment()
    remember_cpu_info(folder)
    import deepspeed.ops  # noqa: F401  (fills __compatible_ops__)

    for name in builder_names:
        builder = accelerator.create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        built = (folder / builder.NAME / f"{builder.NAME}.so").is_file()
        if announce and not built:
            print(f"lavis_ds: compiling DeepSpeed's {OPS.get(name, name)} op '{builder.NAME}' once for this "
                  f"environment into {folder} ({TYPICAL_MINUTES}; later runs reuse it)...", flush=True)
        start = time.perf_counter()
        builder.load(verbose=False)
        if announce and not built:
            print(f"lavis_ds: '{builder.NAME}' compiled in {time.perf_counter() - start:.0f} s", flush=True)


def remember_cpu_info(folder: Path) -> None:
    """Answer py-cpuinfo's question once per CPU instead of several times in every process.

    DeepSpeed's op builders ask ``cpuinfo.get_cpu_info()`` for the compiler flags each time an op
    loads, and py-cpuinfo answers by starting a new Python process: 1.2 s a call here, twice per
    training process. The answer is kept in the environment's extensions folder under a key made
    from this CPU's model and flags, so another CPU (a moved environment) asks again.
    """
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "remembered", False):
        return
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: ask once in this process
        lines = None
    ask = cpuinfo.get_cpu_info
    cache = None
    if lines is not None:
        stable = [line for line in lines if line.startswith(("vendor_id", "model name", "flags"))]
        key = hashlib.sha256("\n".join(sorted(set(stable))).encode()).hexdigest()[:16]
        cache = folder / f"cpuinfo-{key}.json"

    answer: dict = {}

    def get_cpu_info() -> dict:
        if not answer:
            if cache is not None and cache.is_file():
                answer.update(json.loads(cache.read_text()))
            else:
                answer.update(ask())
                if cache is not None and answer:  # written whole or not at all: processes start together
                    folder.mkdir(parents=True, exist_ok=True)
                    partial = cache.with_suffix(f".{os.getpid()}.tmp")
                    partial.write_text(json.dumps(answer))
                    os.replace(partial, cache)
        return dict(answer)

    get_cpu_info.remembered = True
    cpuinfo.get_cpu_info = get_cpu_info


def build_gpu_ops() -> int:
    """On a GPU machine: compile DeepSpeed's CUDA FusedAdam and its CPU Adam (offload) now, or say why not."""
    load_deepspeed()
    from deepspeed.accelerator import get_accelerator

    if cuda_compiler() is None:
        print("lavis_ds: no CUDA compiler (nvcc under CUDA_HOME): runs step torch's fused AdamW instead of DeepSpeed's "
              "FusedAdam; optimizer offload needs the CUDA toolkit or a DeepSpeed built with DS_BUILD_CPU_ADAM=1",
              flush=True)
        return 0
    for name in ("FusedAdamBuilder", "CPUAdamBuilder"):
        builder = get_accelerator().create_op_builder(name)
        start = time.perf_counter()
        print(f"lavis_ds: building DeepSpeed's '{builder.NAME}' with {cuda_compiler()}...", flush=True)
        builder.load(verbose=False)
        print(f"lavis_ds: '{builder.NAME}' ready in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


def main() -> int:
    """Build every op lavis_ds can use on this machine (CPU ops; CUDA ones on a GPU), so that no run waits later."""
    import torch

    if torch.cuda.is_available():
        return build_gpu_ops()
    folder = configure_build_environment()
    print(f"lavis_ds: building DeepSpeed's CPU ops into {folder}", flush=True)
    ensure_built(list(OPS))
    print("lavis_ds: DeepSpeed's CPU ops are ready", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
