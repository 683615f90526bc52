"""A user's objective, registered from a module named under `imports:` (docs/preference.md, "Your own objective").

Conservative DPO (cDPO, Mitchell 2023; TRL's DPO ``label_smoothing``): each preference label is trusted with
probability ``1 - label_smoothing``, so a noisy pair pulls less. Everything else - the pair data, the reference
model without a second copy, the per-pair normalisation, the metrics - is DPO's, inherited.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lavis_ds.common import registry as reg
from lavis_ds.objectives.losses import PairLosses
from lavis_ds.objectives.preference import Dpo
from lavis_ds.objectives.reference import REF_CHOSEN, REF_REJECTED


@reg.objectives.register("cdpo")
class ConservativeDpo(Dpo):
    """DPO whose labels are flipped with probability ``label_smoothing`` (in ``run.cdpo``)."""

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.1, reference: str = "auto"):
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
        super().__init__(beta=beta, reference=reference)
        self.label_smoothing = label_smoothing

    def pair_losses(self, chosen, rejected, chosen_tokens, rejected_tokens, batch) -> PairLosses:
        dpo = super().pair_losses(chosen, rejected, chosen_tokens, rejected_tokens, batch)  # checks the reference
        ref_chosen = torch.as_tensor(batch[REF_CHOSEN], dtype=torch.float64).to(chosen)
        ref_rejected = torch.as_tensor(batch[REF_REJECTED], dtype=torch.float64).to(rejected)
        margin = self.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
        eps = self.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        return PairLosses(losses, dpo.chosen_rewards, dpo.rejected_rewards)
