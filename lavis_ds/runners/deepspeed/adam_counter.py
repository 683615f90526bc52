"""Rebuild the step counter that DeepSpeed's C++ CPU Adam keeps outside every checkpoint.

DeepSpeed's CPU Adam kernel (``FusedAdam`` on a CPU accelerator, and ``DeepSpeedCPUAdam``,
the ZeRO-Offload optimizer on any machine) keeps beta1**t and beta2**t inside the C++ object
and multiplies them by beta once per step. A fresh process that loads a checkpoint at step t
jumps straight to ``std::pow(beta, t)`` instead, which differs in the last bit for some t
(beta2 = 0.999 at t = 3 and 6, beta1 = 0.9 at t = 9 and 12): the first resumed update then
differs from the uninterrupted run's, and the runs drift apart from there.

Replaying the counter with empty tensors, steps 1..t in the order training made them, gives
the kernel the very products the uninterrupted run had, without touching a weight. The CUDA
kernel computes the powers from t at every step and needs nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

from lavis_ds.runners.deepspeed.library import load_deepspeed


def replay_step_counter(optimizer: torch.optim.Optimizer) -> int:
    """Bring the kernel's beta powers to the optimizer's loaded step; returns the steps replayed (0: not needed)."""
    call = _kernel_step(optimizer)
    steps = max([int(state["step"]) for state in optimizer.state.values() if "step" in state]
                + [int(group.get("step", 0)) for group in optimizer.param_groups], default=0)
    if call is None or steps == 0:
        return 0
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:  # the order step() calls the kernel in
            call(step, group)
    return steps


def _kernel_step(optimizer) -> Callable[[int, dict], None] | None:
    """One kernel call for (step, param group) on empty tensors, or None if the optimizer keeps no counter."""
    load_deepspeed()
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    empty = torch.empty(0, dtype=torch.float32)
    if isinstance(optimizer, DeepSpeedCPUAdam):
        def call(step, group):
            beta1, beta2 = group["betas"]
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                              group["weight_decay"], group["bias_correction"],
                                              empty, empty, empty, empty)
        return call
    if isinstance(optimizer, FusedAdam) and _on_cpu(optimizer):
        from deepspeed.ops.adam.fused_adam import multi_tensor_applier

        def call(step, group):
            beta1, beta2 = group["betas"]
            multi_tensor_applier(optimizer.multi_tensor_adam, optimizer._dummy_overflow_buf, [[empty]] * 4,
                                 group["lr"], beta1, beta2, group["eps"], step, optimizer.adam_w_mode,
                                 1 if group["bias_correction"] else 0, group["weight_decay"])
        return call
    return None


def _on_cpu(optimizer) -> bool:
    return all(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
