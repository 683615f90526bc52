"""DeepSpeed's C++ CPU Adam, reloaded from its state dict at any step, continues bit for bit."""
from __future__ import annotations

import copy

import torch

from lavis_ds.runners.deepspeed.adam_counter import replay_step_counter

STEPS = 12


def make_optimizer(param: torch.nn.Parameter) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam([param], lr=1e-3, weight_decay=0.05)  # what ZeRO 0-3 step on a CPU accelerator


def train(optimizer, param, grads) -> None:
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()


# DeepSpeedCPUAdam (ZeRO-Offload) runs the same kernel; tests/test_train.py resumes an offload run end to end.
def test_reloaded_fused_adam_continues_bit_for_bit_only_with_the_counter_replayed():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=generator)
    grads = [torch.randn(4096, generator=generator) for _ in range(STEPS)]

    param = torch.nn.Parameter(start.clone())
    optimizer = make_optimizer(param)
    saved = []  # (weights, optimizer state) after each step, as a checkpoint holds them
    for grad in grads:
        train(optimizer, param, [grad])
        saved.append((param.detach().clone(), copy.deepcopy(optimizer.state_dict())))
    uninterrupted = param.detach().clone()

    def resume_at(step: int, replay: bool) -> torch.Tensor:
        weights, state = saved[step - 1]
        resumed = torch.nn.Parameter(weights.clone())
        fresh = make_optimizer(resumed)
        fresh.load_state_dict(copy.deepcopy(state))
        if replay:
            assert replay_step_counter(fresh) == step
        train(fresh, resumed, grads[step:])
        return resumed.detach()

    for step in range(1, STEPS):
        assert torch.equal(resume_at(step, replay=True), uninterrupted), f"resumed at step {step}"
    # Without the replay the kernel computes beta**t afresh, which is not what an unbroken run multiplied up.
    drifted = [step for step in range(1, STEPS) if not torch.equal(resume_at(step, replay=False), uninterrupted)]
    assert drifted, "the kernel no longer keeps a running product: the replay may be unnecessary"


def test_torch_optimizers_need_no_replay():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    assert replay_step_counter(optimizer) == 0
