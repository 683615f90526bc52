"""Preference losses as pure functions of sequence log-probs (TRL's formulas; tests/test_objective_losses.py
checks each against the installed ``trl`` to 1e-6).

Every function takes per-pair tensors ``[B]``: the summed log-prob of each answer's supervised tokens and,
where a loss is length-normalised, each answer's token count. It returns the per-pair losses ``[B]`` and
the per-pair rewards of both answers ``[B]`` (detached, for the metrics). Reducing over pairs is the
caller's job: the trainer divides the summed losses by the pairs of the whole global batch, so the same
formula serves any micro-batch x accumulation x processes split.
"""
from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

DpoLossType = Literal["sigmoid", "ipo", "hinge"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")


class PairLosses(NamedTuple):
    """Per-pair losses and rewards, ``[B]`` each."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def dpo_losses(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
               beta: float, loss_type: DpoLossType = "sigmoid", chosen_tokens: Tensor | None = None,
               rejected_tokens: Tensor | None = None) -> PairLosses:
    """DPO and its variants against a reference model (TRL ``DPOTrainer``, ``f_divergence_type='reverse_kl'``).

    Args:
        chosen_logps, rejected_logps: the policy's summed answer log-probs.
        ref_chosen_logps, ref_rejected_logps: the reference model's, on the same answers.
        beta: the KL weight (``ipo``: the regulariser tau).
        loss_type: ``sigmoid`` (DPO), ``hinge`` (SLiC/RSO), ``ipo`` (IPO, on log-ratios averaged per answer
            token, as TRL computes it after checking with the IPO authors).
        chosen_tokens, rejected_tokens: answer token counts; required by ``ipo``.
    """
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type 'ipo' averages the log-ratios per answer token: pass chosen_tokens and "
                             "rejected_tokens")
        per_token = chosen_logratios / _tokens(chosen_tokens) - rejected_logratios / _tokens(rejected_tokens)
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    return PairLosses(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def simpo_losses(chosen_logps: Tensor, rejected_logps: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor,
                 beta: float, gamma: float) -> PairLosses:
    """SimPO (reference-free): ``-logsigmoid(beta * (avg_chosen - avg_rejected) - gamma)`` on log-probs averaged per
    answer token (TRL ``CPOTrainer.cpo_loss`` with ``loss_type='simpo'``, ``label_smoothing=0``; ``gamma`` is its
    ``simpo_gamma``). Rewards are ``beta`` times the averaged log-probs, as TRL logs them."""
    chosen_avg = chosen_logps / _tokens(chosen_tokens)
    rejected_avg = rejected_logps / _tokens(rejected_tokens)
    logits = (chosen_avg - rejected_avg) - gamma / beta
    losses = -F.logsigmoid(beta * logits)
    return PairLosses(losses, beta * chosen_avg.detach(), beta * rejected_avg.detach())


def orpo_losses(chosen_logps: Tensor, rejected_logps: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor,
                beta: float) -> PairLosses:
    """ORPO's odds-ratio term (reference-free), ``-beta * logsigmoid(log odds(chosen) - log odds(rejected))`` on
    log-probs averaged per answer token (TRL ``ORPOTrainer.odds_ratio_loss``, negated: TRL subtracts it from the
    NLL). The NLL term of ORPO is the SFT term on the chosen answers, normalised per token by the caller."""
    # at least fp32, as TRL computes it: log(1 - p) of an average near 0 needs the precision
    chosen_avg = _at_least_fp32(chosen_logps / _tokens(chosen_tokens))
    rejected_avg = _at_least_fp32(rejected_logps / _tokens(rejected_tokens))
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    losses = -beta * F.logsigmoid(log_odds)
    return PairLosses(losses, beta * chosen_avg.detach(), beta * rejected_avg.detach())


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation on either side of ``-log 2`` (Maechler's rule)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _tokens(count: Tensor) -> Tensor:
    """Token counts as a divisor: an answer truncated to nothing counts one, so its average is 0, not NaN."""
    return count.to(torch.float32 if not torch.is_floating_point(count) else count.dtype).clamp(min=1)


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))
