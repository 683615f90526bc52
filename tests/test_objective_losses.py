"""The objectives' losses equal TRL's on the same log-probs (1e-6), and do not depend on how a batch is split.

TRL is the installed package (a dev dependency); tests/trl_reference.py runs its loss methods' own source.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from lavis_ds.common.registry import registry
from lavis_ds.objectives import PAIRS, TOKENS, Dpo, Orpo, Simpo, global_loss, micro_batch_weights
from lavis_ds.objectives.losses import dpo_losses, log1mexp
from trl_reference import trl_cpo_loss, trl_dpo, trl_odds_ratio_loss

PAIR_COUNT = 6
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected")


def _answers(seed: int, count: int = PAIR_COUNT) -> list[torch.Tensor]:
    """Per-token log-probs of ``count`` answers of 1..9 tokens (float64, so 1e-6 measures the formula)."""
    g = torch.Generator().manual_seed(seed)
    return [-3 * torch.rand(int(torch.randint(1, 10, (1,), generator=g)), generator=g, dtype=torch.float64)
            for _ in range(count)]


@pytest.fixture
def pairs():
    chosen, rejected = _answers(1), _answers(2)
    g = torch.Generator().manual_seed(3)
    ref_chosen = torch.stack([a.sum() for a in chosen]) + torch.randn(PAIR_COUNT, generator=g, dtype=torch.float64)
    ref_rejected = torch.stack([a.sum() for a in rejected]) + torch.randn(PAIR_COUNT, generator=g, dtype=torch.float64)
    return chosen, rejected, ref_chosen, ref_rejected


def _sums(answers):
    return torch.stack([a.sum() for a in answers]), torch.tensor([len(a) for a in answers])


def _ours(objective, chosen, rejected, ref_chosen=None, ref_rejected=None):
    """The objective's step loss and metrics when the whole batch is one micro-batch on one process."""
    (c, ct), (r, rt) = _sums(chosen), _sums(rejected)
    batch = {"ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    out = objective.from_logps(c, r, ct, rt, batch)
    return global_loss([out], [{PAIRS: len(chosen), TOKENS: int(ct.sum())}])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_and_metrics_equal_trl(pairs, loss_type):
    chosen, rejected, ref_c, ref_r = pairs
    beta = 0.3 if loss_type != "hinge" else 0.5  # hinge: a beta at which some pairs are past the margin (relu = 0)
    loss, metrics = _ours(Dpo(beta=beta, loss_type=loss_type), chosen, rejected, ref_c, ref_r)
    trl_loss, trl_metrics = trl_dpo(chosen, rejected, ref_c, ref_r, beta, [loss_type])
    assert float(loss) == pytest.approx(float(trl_loss), abs=1e-6, rel=1e-6)
    for name in TRL_METRICS:
        assert metrics[name] == pytest.approx(trl_metrics[name], abs=1e-6), name
    if loss_type == "hinge":
        per_pair = dpo_losses(_sums(chosen)[0], _sums(rejected)[0], ref_c, ref_r, beta, "hinge").losses
        assert (per_pair == 0).any() and (per_pair > 0).any()  # both sides of the hinge are exercised


def test_dpo_rpo_alpha_equals_trl_sigmoid_plus_weighted_sft(pairs):
    """ms-swift's rpo_alpha is TRL's loss_type=["sigmoid", "sft"] with loss_weights=[1, rpo_alpha]."""
    chosen, rejected, ref_c, ref_r = pairs
    loss, metrics = _ours(Dpo(beta=0.2, rpo_alpha=0.7), chosen, rejected, ref_c, ref_r)
    trl_loss, _ = trl_dpo(chosen, rejected, ref_c, ref_r, 0.2, ["sigmoid", "sft"], [1.0, 0.7])
    assert float(loss) == pytest.approx(float(trl_loss), abs=1e-6, rel=1e-6)
    plain, _ = _ours(Dpo(beta=0.2), chosen, rejected, ref_c, ref_r)
    assert float(loss) - float(plain) > 0.1  # the SFT term is really there
    assert metrics["nll"] == pytest.approx(-float(torch.cat(chosen).mean()), abs=1e-9)


@pytest.mark.parametrize("sft_alpha", [0.0, 0.5])
def test_simpo_equals_trl_cpo_simpo(pairs, sft_alpha):
    """TRL's CPO loss (``loss_type='simpo'``) is TRL's code; its CPO-SimPO NLL term (``cpo_alpha`` times
    ``nn.CrossEntropyLoss`` over the chosen answers' labels, a token mean) is computed here from that formula."""
    chosen, rejected, _, _ = pairs
    loss, metrics = _ours(Simpo(beta=2.0, simpo_gamma=1.2, sft_alpha=sft_alpha), chosen, rejected)
    (c, ct), (r, rt) = _sums(chosen), _sums(rejected)
    losses, chosen_rewards, rejected_rewards = trl_cpo_loss(c / ct, r / rt, beta=2.0, loss_type="simpo",
                                                            simpo_gamma=1.2)
    trl_loss = losses.mean() + sft_alpha * -torch.cat(chosen).mean()
    assert float(loss) == pytest.approx(float(trl_loss), abs=1e-6, rel=1e-6)
    assert metrics["rewards/chosen"] == pytest.approx(float(chosen_rewards.mean()), abs=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(float((chosen_rewards - rejected_rewards).mean()), abs=1e-6)


def test_orpo_equals_trl_odds_ratio_loss_plus_chosen_nll(pairs):
    """TRL's ``odds_ratio_loss`` is TRL's code. ORPO's NLL term here is the chosen answers' token-mean NLL; TRL's
    ORPO computes it over prompt and answer (lavis_ds supervises answers only), so that term is the formula."""
    chosen, rejected, _, _ = pairs
    loss, metrics = _ours(Orpo(beta=0.25), chosen, rejected)
    (c, ct), (r, rt) = _sums(chosen), _sums(rejected)
    losses, chosen_rewards, _, _, _ = trl_odds_ratio_loss(c / ct, r / rt, beta=0.25)
    trl_loss = -torch.cat(chosen).mean() - losses.mean()
    assert float(loss) == pytest.approx(float(trl_loss), abs=1e-6, rel=1e-6)
    assert metrics["rewards/chosen"] == pytest.approx(float(chosen_rewards.mean()), abs=1e-6)


def test_log1mexp_is_accurate_on_both_branches():
    x = torch.tensor([-1e-8, -0.5, -0.7, -5.0, -40.0], dtype=torch.float64)
    exact = torch.tensor([float(torch.log(-torch.expm1(v))) for v in x], dtype=torch.float64)
    assert torch.allclose(log1mexp(x), exact, rtol=1e-12)


@pytest.mark.parametrize("objective", [Dpo(beta=0.1, rpo_alpha=0.5), Dpo(beta=0.1, loss_type="ipo"),
                                       Simpo(beta=2.0, sft_alpha=0.3), Orpo(beta=0.1)],
                         ids=["dpo+rpo", "ipo", "simpo+sft", "orpo"])
@pytest.mark.parametrize("split", [(1, 1, 8), (2, 1, 4), (1, 2, 4), (2, 2, 2), (4, 2, 1)],
                         ids=lambda s: "micro{2}xaccum{0}xranks{1}".format(*s))
def test_step_loss_does_not_depend_on_the_split(objective, split):
    """8 pairs as (accumulation x processes) micro-batches: each micro-batch's share, weighted as the trainer weights
    it (``micro_batch_weights`` from the all-reduced counts) and averaged as the engines average, gives the loss
    and gradient of the 8 pairs as one batch (1e-12)."""
    accum, ranks, micro = split
    chosen, rejected = _answers(5, 8), _answers(6, 8)
    (c, ct), (r, rt) = _sums(chosen), _sums(rejected)
    ref_c, ref_r = c + 0.3, r - 0.2
    c.requires_grad_(True)

    def share(idx):
        batch = {"ref_chosen_logps": ref_c[idx], "ref_rejected_logps": ref_r[idx]}
        return objective.from_logps(c[idx], r[idx], ct[idx], rt[idx], batch), {PAIRS: len(idx),
                                                                                TOKENS: int(ct[idx].sum())}

    whole, whole_counts = share(torch.arange(8))
    reference, _ = global_loss([whole], [whole_counts])
    (reference_grad,) = torch.autograd.grad(reference, c)

    parts = [share(torch.arange(start, start + micro)) for start in range(0, 8, micro)]
    totals = {unit: sum(counts[unit] for _, counts in parts) for unit in (PAIRS, TOKENS)}
    weights = micro_batch_weights(totals, accum, ranks)
    engine_loss = sum(sum(out.loss_sums[u] * weights[u] for u in out.loss_sums) for out, _ in parts) / (accum * ranks)
    (grad,) = torch.autograd.grad(engine_loss, c)
    assert float(engine_loss.detach()) == pytest.approx(float(reference.detach()), abs=1e-12)
    assert torch.allclose(grad, reference_grad, atol=1e-12)
    split_metrics = global_loss([out for out, _ in parts], [counts for _, counts in parts])[1]
    for name, value in global_loss([whole], [whole_counts])[1].items():
        assert split_metrics[name] == pytest.approx(value, abs=1e-12), name


@pytest.mark.parametrize("name", ["dpo", "orpo", "sft", "simpo"])
def test_every_registered_objective_builds_from_an_empty_section(name):
    from lavis_ds.common.registry import objectives

    assert sorted(objectives) == ["dpo", "orpo", "sft", "simpo"]  # a registered objective joins the list above
    cls = registry.get_objective_class(name)
    built = cls.from_config({})
    assert type(built) is cls and built.DATA in ("sequences", "pairs") and built.UNITS
    assert set(built.UNITS) <= {PAIRS, TOKENS}
    # An empty section means the constructor's defaults (None: a default the constructor resolves itself)
    defaults = {p.name: p.default for p in inspect.signature(cls).parameters.values()
                if p.default is not p.empty and p.default is not None}
    assert {k: getattr(built, k) for k in defaults if hasattr(built, k)} == {
        k: v for k, v in defaults.items() if hasattr(built, k)}
