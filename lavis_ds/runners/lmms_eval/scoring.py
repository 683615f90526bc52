"""The log-likelihood of a continuation, for lmms-eval's multiple-choice tasks: computed inside the model's forward.

A batch that carries ``objective`` is scored by it inside the root module's forward
(``VisionLLM.forward``), where ZeRO-3 and FSDP2 have gathered the root's own parameters; the trainer's engine
runs that forward (``engine.forward``) on every rank. :class:`ContinuationScorer` is such an objective: it returns,
per sample, the summed log-probability of the answer's tokens (the continuation; the end-of-turn token the chat
template closes the answer with is not part of it), their number, and whether greedy decoding picks every one of them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lavis_ds.common.errors import InputError
from lavis_ds.models.lm_loss import picked, supervised_targets
from lavis_ds.models.vision_llm_batch import sample_of_positions

# What a model needs to give log-likelihoods: the shared vision-LLM core's batch layout and input splice.
SCORING_NEEDS = ("prepare_batch", "_inputs", "llm_model", "llm")


def scoring_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot give continuation log-likelihoods (None: it can)."""
    missing = [name for name in SCORING_NEEDS if not hasattr(model, name)]
    if missing:
        return (f"{type(model).__name__} cannot give log-likelihoods (it has no {', '.join(missing)}: it is not built "
                "on lavis_ds's vision-LLM core, lavis_ds.models.vision_llm)")
    return None


class ContinuationScorer:
    """``scorer(model, batch)`` inside the model's forward: ``{"logp": [B] fp32, "tokens": [B] long, "greedy": [B]
    bool, "complete": [B] bool}`` for a batch whose ``output`` holds each sample's continuation as its one answer
    (``complete``: no token of it was cut by the model's ``max_txt_len``)."""

    def __call__(self, model: torch.nn.Module, samples: dict[str, Any]) -> "ContinuationScores":
        samples = {k: v for k, v in samples.items() if k != "objective"}
        prepared = model.prepare_batch(samples)
        inputs_embeds, layout, labels = model._inputs(prepared, None)
        positions, targets = supervised_targets(labels, prepared.get("supervised_positions"))
        # The full logits of the supervised rows only: an evaluation batch holds short continuations.
        logits = model.llm_model(inputs_embeds=inputs_embeds, use_cache=False, **layout).logits
        logprobs = F.log_softmax(picked(logits, positions).float(), dim=-1)
        token_logps = logprobs.gather(1, targets[:, None])[:, 0]
        greedy = logprobs.argmax(-1) == targets
        owner, num_samples = sample_of_positions(prepared, positions, labels)
        # Each sample's last supervised token closes its turn (end of turn): not part of the continuation.
        is_last = torch.ones_like(owner, dtype=torch.bool)
        is_last[:-1] = owner[1:] != owner[:-1]
        closes = is_last & torch.isin(targets, torch.tensor(model.llm.stop_token_ids(), device=targets.device))
        keep = ~closes
        logp = torch.zeros(num_samples, device=owner.device).index_add(0, owner, token_logps * keep)
        misses = torch.zeros(num_samples, dtype=torch.long, device=owner.device).index_add(
            0, owner, (~greedy & keep).long())
        tokens = torch.zeros(num_samples, dtype=torch.long, device=owner.device).index_add(0, owner, keep.long())
        # An answer the prompt's max_txt_len cut keeps no end-of-turn token: its log-likelihood would be a part's.
        complete = torch.zeros(num_samples, dtype=torch.long, device=owner.device).index_add(0, owner, closes.long())
        return ContinuationScores(logp, tokens, misses == 0, complete > 0)


class ContinuationScores:
    def __init__(self, logp: torch.Tensor, tokens: torch.Tensor, greedy: torch.Tensor, complete: torch.Tensor):
        self.logp, self.tokens, self.greedy, self.complete = logp, tokens, greedy, complete

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Plain dicts, as a forward returns them (FSDP2 and ZeRO-3 find a forward's output tensors in dicts)."""
        return {"logp": self.logp, "tokens": self.tokens, "greedy": self.greedy, "complete": self.complete}


def check_complete(complete: list[bool], wheres: list[str], model: torch.nn.Module) -> None:
    """Refuse, in one line, requests whose continuation the model's ``max_txt_len`` cut (or cut away)."""
    cut = [where for where, whole in zip(wheres, complete) if not whole]
    if cut:
        limit = model.llm.prompt.max_len  # SCORING_NEEDS: a vision-LLM core, which holds the LLM part
        raise InputError(f"{cut[0]}{f' and {len(cut) - 1} more' if len(cut) > 1 else ''}: the model's max_txt_len="
                         f"{limit} cuts the continuation, so its log-likelihood cannot be computed; raise "
                         "model.max_txt_len (config.yaml of an export) or shorten the task's prompt")
