"""The preference objectives: ``dpo`` (sigmoid, ipo, hinge; optional RPO term), reference-free ``simpo`` and ``orpo``.

Each trains on pair micro-batches (``lavis_ds.datasets.preference``): it runs the vision tower once on the
pairs' images and scores the chosen and rejected answers in one forward (``model_calls``), then applies its
pure loss function (``losses``). The unit of the preference term is the pair; an SFT term on the chosen
answers (``dpo``'s ``rpo_alpha``, ORPO's NLL) is a sum over their tokens. Both are divided by the global batch's
count of their unit (``base``), so the loss is TRL's mean over pairs and its token-mean NLL whatever the split.

Logged, as TRL names them: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
``logps/chosen``, ``logps/rejected`` (means over the global batch's pairs), and ``nll`` for an SFT term; and
``logps/accuracies``, the share of pairs whose chosen answer the model itself finds likelier (its own preference,
comparable between models, where ``rewards/accuracies`` is relative to the reference).
"""
from __future__ import annotations

from typing import Annotated, Any

import torch
from torch import Tensor

from lavis_ds.common.errors import LavisDsError
from lavis_ds.common import registry as reg
from lavis_ds.common.schema import Range
from lavis_ds.objectives import model_calls
from lavis_ds.objectives.base import PAIRS, TOKENS, Objective, ObjectiveOutput
from lavis_ds.objectives.losses import DpoLossType, PairLosses, dpo_losses, orpo_losses, simpo_losses
from lavis_ds.objectives.reference import (REF_CHOSEN, REF_REJECTED, ReferenceKind, adapter_reference_logps,
                                           precomputed_store, resolve_kind)

Positive = Range(gt=0)



class PreferenceObjective(Objective):
    """What every pairwise objective shares: the model calls, the counts, the metrics. Subclasses say the loss."""

    DATA = "pairs"
    UNITS = (PAIRS, TOKENS)

    def sft_weight(self) -> float:
        """Weight of the SFT term on the chosen answers (0: none)."""
        return 0.0

    def setup(self, model: torch.nn.Module) -> None:
        """Dropout off (TRL's ``disable_dropout``, on by default): a pair's two answers, and the policy and the
        reference, are then scored by the same function, so the first step's rewards are 0 as DPO assumes."""
        disable_dropout(model)

    def prepare(self, model: torch.nn.Module, batch: dict[str, Any], pack_to: int | None = None) -> dict[str, Any]:
        """Both sides tokenized (``model_calls.prepare_pairs``), the batch naming this objective to score it."""
        if "num_pairs" not in batch:
            batch = model_calls.prepare_pairs(model, batch)
        return {**batch, "objective": self}

    def counts(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, int]:
        counts = {PAIRS: int(batch["num_pairs"])}
        if self.sft_weight():
            labels = batch["labels"][: counts[PAIRS], 1:]
            counts[TOKENS] = int((labels != model_calls.IGNORE_INDEX).sum())
        return counts

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> ObjectiveOutput:
        if "num_pairs" not in batch:  # called on a collated batch (a test, a script): prepared here
            batch = model_calls.prepare_pairs(model, batch)
        features = model_calls.image_features(model, batch)  # the vision pass once; both sides take the features
        logps, tokens = model_calls.answer_logps(model, batch, features)
        pairs = int(batch["num_pairs"])
        batch = {**batch, **self.reference_logps(model, batch, features)}
        return self.record(self.from_logps(logps[:pairs], logps[pairs:], tokens[:pairs], tokens[pairs:], batch))

    def reference_logps(self, model: torch.nn.Module, batch: dict[str, Any], features: Tensor) -> dict[str, Tensor]:
        """The reference model's log-probs this step computes itself (none: reference-free, or precomputed)."""
        return {}

    def pair_losses(self, chosen: Tensor, rejected: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor,
                    batch: dict[str, Any]) -> PairLosses:
        raise NotImplementedError

    def from_logps(self, chosen: Tensor, rejected: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor,
                   batch: dict[str, Any]) -> ObjectiveOutput:
        """The loss terms and metrics of B pairs from their answers' summed log-probs and token counts."""
        result = self.pair_losses(chosen, rejected, chosen_tokens, rejected_tokens, batch)
        loss_sums = {PAIRS: result.losses.sum()}
        metrics = pair_metrics(result, chosen, rejected)
        if self.sft_weight():
            nll = -chosen.sum()  # the chosen answers' summed token NLL: an SFT term, per token
            loss_sums[TOKENS] = self.sft_weight() * nll
            metrics["nll"] = (TOKENS, nll.detach())
        return ObjectiveOutput(loss_sums, metrics)


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of ``model`` set to 0: ``nn.Dropout`` (peft's LoRA dropout too), timm's stochastic depth
    (``drop_prob``) and the attention dropout transformers' attention modules read from ``attention_dropout``."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("drop_prob", "attention_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def pair_metrics(result: PairLosses, chosen: Tensor, rejected: Tensor) -> dict[str, tuple[str, Tensor]]:
    """TRL's logged names, each summed over the micro-batch's pairs (divided by the global pairs, like the loss)."""
    c, r = result.chosen_rewards, result.rejected_rewards
    sums = {"rewards/chosen": c.sum(), "rewards/rejected": r.sum(), "rewards/margins": (c - r).sum(),
            "rewards/accuracies": (c > r).float().sum(), "logps/accuracies": (chosen > rejected).float().sum(),
            "logps/chosen": chosen.detach().sum(),
            "logps/rejected": rejected.detach().sum()}
    return {name: (PAIRS, value.detach().double()) for name, value in sums.items()}


@reg.objectives.register("dpo")
class Dpo(PreferenceObjective):
    """Direct Preference Optimization against a reference model, and its IPO and hinge variants."""

    def __init__(self, beta: Annotated[float, Positive] = 0.1, loss_type: DpoLossType = "sigmoid",
                 rpo_alpha: Annotated[float | None, Range(ge=0)] = None, reference: ReferenceKind = "auto"):
        """
        Args:
            beta: KL weight (IPO: its tau). TRL's, LLaMA-Factory's and ms-swift's default: 0.1.
            loss_type: ``sigmoid`` (DPO), ``ipo``, or ``hinge``.
            rpo_alpha: Weight of an SFT term on the chosen answers (RPO; ms-swift's ``--rpo_alpha``, TRL's
                ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, rpo_alpha]``): their token-mean NLL.
            reference: How the reference model's log-probs are had, without a second copy of the model:
                ``adapters`` (the same model with its LoRA adapters disabled, in the same step: exact when only
                fresh adapters train), ``precomputed`` (one pass over the pairs before training, stored in the run
                folder), or ``auto`` (adapters where exact, else precomputed). See ``objectives.reference``.
        """
        self.beta, self.loss_type, self.rpo_alpha = beta, loss_type, rpo_alpha
        self.reference = reference

    def sft_weight(self) -> float:
        return self.rpo_alpha or 0.0

    def setup(self, model: torch.nn.Module) -> None:
        """Dropout off, and ``auto`` settled on the starting weights before an engine wraps them
        (``reference.resolve_kind``)."""
        super().setup(model)
        self.reference = resolve_kind(self.reference, model)

    def before_train(self, trainer: Any, resuming: bool) -> None:
        """``precomputed``: the reference pass over the training and validation pairs, or its stored result."""
        if self.reference != "precomputed":
            return
        self.store = precomputed_store(trainer, resuming)

    def prepare(self, model: torch.nn.Module, batch: dict[str, Any], pack_to: int | None = None) -> dict[str, Any]:
        store = getattr(self, "store", None)
        if store is not None and REF_CHOSEN not in batch:
            batch = {**batch, **store.lookup(batch)}
        return super().prepare(model, batch, pack_to)

    def reference_logps(self, model, batch, features) -> dict[str, Tensor]:
        if REF_CHOSEN in batch:  # precomputed, looked up when the batch was prepared
            return {}
        if self.reference == "adapters":
            return adapter_reference_logps(model, batch, features)
        return {}

    def pair_losses(self, chosen, rejected, chosen_tokens, rejected_tokens, batch) -> PairLosses:
        missing = [key for key in (REF_CHOSEN, REF_REJECTED) if key not in batch]
        if missing:
            raise LavisDsError(f"run.task: dpo needs the reference model's log-probs of each pair "
                               f"({', '.join(missing)} missing from the batch): run.dpo.reference is "
                               f"{self.reference!r}; the trainer resolves 'auto' and runs the reference pass "
                               f"before training (objectives.reference)")
        # fp32 at least (lists of floats from the precomputed store, or the adapter-disabled model's fp32 log-probs)
        ref_chosen = torch.as_tensor(batch[REF_CHOSEN], dtype=torch.float64).to(chosen)
        ref_rejected = torch.as_tensor(batch[REF_REJECTED], dtype=torch.float64).to(rejected)
        return dpo_losses(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type,
                          chosen_tokens, rejected_tokens)


@reg.objectives.register("simpo")
class Simpo(PreferenceObjective):
    """SimPO: reference-free, on log-probs averaged per answer token, with a target margin."""

    def __init__(self, beta: Annotated[float, Positive] = 0.1, gamma: float | None = None,
                 simpo_gamma: float | None = None, sft_alpha: Annotated[float, Range(ge=0)] = 0.0):
        """
        Args:
            beta: Reward scale (TRL's CPO default 0.1; the SimPO paper uses 2.0-2.5).
            gamma: Target reward margin (``gamma / beta`` in log-prob units); default 0.5, TRL's.
            simpo_gamma: TRL's and LLaMA-Factory's spelling of ``gamma`` (give one of the two).
            sft_alpha: Weight of an SFT term on the chosen answers (TRL's ``cpo_alpha``): CPO-SimPO.
        """
        if gamma is not None and simpo_gamma is not None and gamma != simpo_gamma:
            raise ValueError(f"gamma={gamma} and simpo_gamma={simpo_gamma} are one setting in two spellings; give one")
        self.beta, self.sft_alpha = beta, sft_alpha
        self.gamma = next((g for g in (gamma, simpo_gamma) if g is not None), 0.5)

    def sft_weight(self) -> float:
        return self.sft_alpha

    def pair_losses(self, chosen, rejected, chosen_tokens, rejected_tokens, batch) -> PairLosses:
        return simpo_losses(chosen, rejected, chosen_tokens, rejected_tokens, self.beta, self.gamma)


@reg.objectives.register("orpo")
class Orpo(PreferenceObjective):
    """ORPO: the chosen answers' NLL plus ``beta`` times the odds-ratio loss; reference-free."""

    def __init__(self, beta: Annotated[float, Positive] = 0.1):
        """
        Args:
            beta: Weight of the odds-ratio term (ORPO's lambda; TRL's default 0.1).
        """
        self.beta = beta

    def sft_weight(self) -> float:
        return 1.0

    def pair_losses(self, chosen, rejected, chosen_tokens, rejected_tokens, batch) -> PairLosses:
        return orpo_losses(chosen, rejected, chosen_tokens, rejected_tokens, self.beta)
