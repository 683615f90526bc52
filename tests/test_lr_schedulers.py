import math

import pytest
import torch

from lavis_ds.common import registry as reg
from lavis_ds.common.registry import registry
import lavis_ds.optim  # noqa: F401


def _optimizer():
    p = torch.nn.Parameter(torch.zeros(1))
    q = torch.nn.Parameter(torch.zeros(1))
    return torch.optim.SGD([{"params": [p], "lr_scale": 1.0}, {"params": [q], "lr_scale": 0.1}], lr=0.0)


def _run(name, steps, **kw):
    opt = _optimizer()
    sched = registry.get_lr_scheduler_class(name)(opt, **kw)
    seen = []
    for _ in range(steps):
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
        sched.step()
    return seen, sched


def test_cosine_follows_its_formula_with_scaled_groups():
    kw = dict(init_lr=1e-3, min_lr=1e-5, warmup_lr=1e-6, warmup_steps=4, total_steps=20, steps_per_epoch=10)
    seen, _ = _run("linear_warmup_cosine_lr", 20, **kw)
    for s, (lr, scaled) in enumerate(seen):
        if s < 4:
            want = 1e-6 + (1e-3 - 1e-6) * s / 4
        else:
            want = 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * (s - 4) / 16))
        assert lr == pytest.approx(want, rel=1e-12)
        assert scaled == pytest.approx(0.1 * want, rel=1e-12)
    assert seen[4][0] == pytest.approx(1e-3)


def test_step_schedule_decays_per_epoch_and_respects_min_lr():
    seen, _ = _run("linear_warmup_step_lr", 30, init_lr=1.0, min_lr=0.005, warmup_lr=0.0, warmup_steps=2,
                   total_steps=30, steps_per_epoch=10, decay_rate=0.1)
    assert [seen[s][0] for s in (0, 1, 2, 9, 10, 19, 20, 29)] == pytest.approx([0, 0.5, 1, 1, 0.1, 0.1, 0.01, 0.01])
    seen, _ = _run("linear_warmup_step_lr", 40, init_lr=1.0, min_lr=0.005, warmup_steps=0,
                   total_steps=40, steps_per_epoch=10, decay_rate=0.1)
    assert seen[35][0] == pytest.approx(0.005)


def test_constant_after_warmup():
    seen, _ = _run("constant_lr", 6, init_lr=0.3, warmup_lr=0.1, warmup_steps=2, total_steps=6, steps_per_epoch=6)
    assert [lr for lr, _ in seen] == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3, 0.3])


@pytest.mark.parametrize("name", sorted(reg.lr_schedulers))
def test_state_dict_round_trip_restores_the_lr(name):
    kw = dict(init_lr=1e-3, min_lr=1e-5, warmup_steps=3, total_steps=12, steps_per_epoch=4)
    seen, sched = _run(name, 7, **kw)
    opt = _optimizer()
    fresh = registry.get_lr_scheduler_class(name)(opt, **kw)
    fresh.load_state_dict(sched.state_dict())
    assert opt.param_groups[0]["lr"] == sched.get_lr() == sched.lr_at(7)
