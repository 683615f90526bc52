"""The GPU details that can be checked on a CPU machine: the numerics switches, the refusals' messages, and
DeepSpeed stepping torch's fused AdamW where no CUDA compiler is."""
from __future__ import annotations

import os

import pytest
import torch

from lavis_ds.common import device
from lavis_ds.config import ConfigError, load_config
from lavis_ds.runners.deepspeed import ops
from run_utils import REPO, free_port

DEMO = REPO / "projects/demo/tiny_zero2.yaml"


def test_run_tf32_and_deterministic_are_checked_run_keys():
    cfg = load_config(DEMO, ["run.deterministic=true"])
    assert cfg.run.tf32 is True and cfg.run.deterministic is True
    with pytest.raises(ConfigError, match=r"run\.deterministic"):
        load_config(DEMO, ["run.deterministic=sometimes"])


def test_the_numerics_switches_set_what_they_name(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        device.configure_numerics(tf32=False, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.deterministic is True
    finally:
        device.configure_numerics(tf32=True, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cuda.matmul.allow_tf32 is True


def test_an_op_without_a_deterministic_kernel_is_named():
    # torch's own wording (aten/src/ATen/Context.cpp, alertNotDeterministic); no CPU op raises it, CUDA ones do.
    raised = RuntimeError("scatter_add_cuda_kernel does not have a deterministic implementation, but you set "
                          "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
                          "operation, or you can use the 'warn_only=True' option, if that's acceptable for your "
                          "application.")
    named = device.deterministic_error(raised)
    assert named is not None and str(named).startswith("run.deterministic: an operation of this run has no "
                                                        "deterministic implementation")
    assert "scatter_add_cuda_kernel" in str(named) and "run.deterministic=false" in str(named)
    assert device.deterministic_error(RuntimeError("CUDA out of memory")) is None


def test_a_cpu_machine_binds_no_gpu_and_finds_no_gpu_shared():
    assert device.bind_local_device() == torch.device("cpu")
    device.check_one_gpu_per_process()  # no process group: nothing shared, no collective


def test_without_a_cuda_compiler_deepspeed_steps_torch_fused_adamw(monkeypatch):
    """On a GPU machine with neither nvcc nor a prebuilt FusedAdam, the DeepSpeed config asks for torch's fused
    AdamW; DeepSpeed builds exactly that optimizer from it (checked here on the CPU, where fused AdamW exists too)."""
    import deepspeed

    from lavis_ds.common import comm

    monkeypatch.setattr(ops, "cuda_compiler", lambda: None)  # this machine has nvcc; the user's has not
    monkeypatch.setattr(ops, "prebuilt", lambda name: False)
    ds_config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
                 "zero_optimization": {"stage": 2}}
    changed, note = ops.adam_for_this_machine(ds_config, on_gpu=True)
    assert note.startswith("lavis_ds: no CUDA compiler") and "fused" in note
    assert changed["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.95], "torch_adam": True, "fused": True}
    assert ops.adam_for_this_machine(ds_config, on_gpu=False) == (ds_config, None)
    offload = {**ds_config, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert ops.adam_for_this_machine(offload, on_gpu=True) == (offload, None)
    assert "offload_optimizer" in ops.gpu_problems(offload, on_gpu=True)[0]
    assert ops.gpu_problems(offload, on_gpu=False) == []

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    try:
        engine, _, _, _ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config=changed)
        inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
        assert type(inner) is torch.optim.AdamW and inner.defaults["fused"] is True
        assert tuple(inner.defaults["betas"]) == (0.9, 0.95)
    finally:
        comm.destroy()  # the suite's other in-process tests run without a process group


def test_an_arch_specific_cuda_arch_list_is_rewritten_for_deepspeeds_builder(monkeypatch, capsys):
    """CUDA images for Hopper set TORCH_CUDA_ARCH_LIST entries such as '9.0a', which DeepSpeed's JIT builder cannot
    sort (every DeepSpeed run on such a GPU machine stopped at deepspeed.initialize): its real FusedAdam builder
    reads the list once it is rewritten."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, whatever this machine has

    builder = FusedAdamBuilder()
    builder.jit_mode = True  # as deepspeed.initialize loads it
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a;9.0 10.0f+PTX")
    with pytest.raises(ValueError, match="invalid literal for int"):
        builder.compute_capability_args()
    ops.make_arch_list_readable(announce=True)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    assert "TORCH_CUDA_ARCH_LIST='8.0 9.0a;9.0 10.0f+PTX' has entries" in capsys.readouterr().out
    builder.compute_capability_args()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"  # what DeepSpeed then builds for

    assert ops.arch_list_deepspeed_reads("8.6;9.0+PTX") is None  # a list it reads is left as it is
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")
    ops.make_arch_list_readable(announce=False)
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ  # nothing numbered left: DeepSpeed builds for the GPUs it finds
