"""Learning-rate schedules, stepped once per optimizer step.

They set ``param_group["lr"]`` themselves instead of subclassing
``torch.optim.lr_scheduler``, which refuses DeepSpeed's optimizer wrappers
("... is not an Optimizer"). ``lr_at(step)`` is the pure formula; ``step``
numbers are 0-based optimizer steps, so step ``s`` trains with ``lr_at(s)``.
"""
from __future__ import annotations

import math

from lavis_ds.common import registry as reg


class LRScheduler:
    """Linear warmup from ``warmup_lr`` to ``init_lr`` over ``warmup_steps``, then ``after_warmup``."""

    def __init__(self, optimizer, *, init_lr: float, min_lr: float = 0.0, warmup_lr: float = 0.0,
                 warmup_steps: int = 0, total_steps: int, steps_per_epoch: int, **_unused):
        self.optimizer = optimizer
        self.init_lr, self.min_lr, self.warmup_lr = init_lr, min_lr, warmup_lr
        self.warmup_steps, self.total_steps, self.steps_per_epoch = warmup_steps, total_steps, steps_per_epoch
        self.last_step = 0
        self._apply()

    @classmethod
    def from_config(cls, optimizer, run, total_steps: int, steps_per_epoch: int) -> "LRScheduler":
        warmup = run.warmup_steps if run.warmup_ratio is None else round(run.warmup_ratio * total_steps)
        return cls(optimizer, init_lr=run.init_lr, min_lr=run.min_lr, warmup_lr=run.warmup_lr,
                   warmup_steps=warmup, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                   decay_rate=run.lr_decay_rate)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr + (self.init_lr - self.warmup_lr) * step / self.warmup_steps
        return self.after_warmup(step)

    def after_warmup(self, step: int) -> float:
        return self.init_lr

    def step(self) -> None:
        """Call once after each optimizer step."""
        self.last_step += 1
        self._apply()

    def _apply(self) -> None:
        lr = self.lr_at(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def get_lr(self) -> float:
        return self.lr_at(self.last_step)

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = state["last_step"]
        self._apply()


@reg.lr_schedulers.register("constant_lr")
class ConstantLR(LRScheduler):
    """Warmup, then ``init_lr``."""


@reg.lr_schedulers.register("linear_warmup_cosine_lr")
class LinearWarmupCosineLR(LRScheduler):
    """Warmup, then a half cosine from ``init_lr`` down to ``min_lr`` at the last step."""

    def after_warmup(self, step: int) -> float:
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + (self.init_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@reg.lr_schedulers.register("linear_warmup_step_lr")
class LinearWarmupStepLR(LRScheduler):
    """Warmup, then ``init_lr * decay_rate ** epoch``, never below ``min_lr`` (LAVIS's step schedule)."""

    def __init__(self, optimizer, *, decay_rate: float = 0.1, **kwargs):
        self.decay_rate = decay_rate
        super().__init__(optimizer, **kwargs)

    def after_warmup(self, step: int) -> float:
        epoch = step // max(1, self.steps_per_epoch)
        return max(self.min_lr, self.init_lr * self.decay_rate ** epoch)
