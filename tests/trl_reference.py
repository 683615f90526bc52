"""TRL's own loss code, run on given log-probs: the reference the objectives' losses are checked against.

TRL's loss code lives in trainer methods (``DPOTrainer._compute_loss``, ``CPOTrainer.cpo_loss``,
``ORPOTrainer.odds_ratio_loss``) whose modules import ``datasets`` (and so pyarrow), which the test environment
does not install. So each method's source is read from the installed ``trl`` package, compiled as it is, and
called with the few attributes it reads (beta, loss type, a CPU "accelerator" whose gathers are identities on
one process). What runs is TRL's installed code, line for line; only its imports are supplied.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import math
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

TRL_ROOT = Path(importlib.util.find_spec("trl").origin).parent


def trl_function(relative_path: str, qualname: str, namespace: dict):
    """The function ``qualname`` (``Class.method`` or ``function``) of ``trl/<relative_path>``, compiled from the
    installed source with ``namespace`` as its globals."""
    path = TRL_ROOT / relative_path
    tree = ast.parse(path.read_text())
    *owner, name = qualname.split(".")
    body = tree.body
    for cls in owner:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []  # a @staticmethod etc. means nothing outside its class
    module = ast.Module(body=[node], type_ignores=[])
    namespace = {"torch": torch, "F": F, "math": math, "warnings": warnings, **namespace}
    exec(compile(module, str(path), "exec"), namespace)
    return namespace[name]


def _accelerator() -> SimpleNamespace:
    same = lambda x: x  # noqa: E731  (one process: gathering returns the tensor itself)
    return SimpleNamespace(device=torch.device("cpu"), gather=same, gather_for_metrics=same)


def trl_dpo(chosen_token_logps: list[torch.Tensor], rejected_token_logps: list[torch.Tensor],
            ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float, loss_types: list[str],
            loss_weights: list[float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL ``DPOTrainer._compute_loss`` (``precompute_ref_log_probs``: the reference log-probs come with the batch)
    on per-token answer log-probs, one tensor per answer. Returns TRL's loss and its logged metrics."""
    compute = trl_function("trainer/dpo_trainer.py", "DPOTrainer._compute_loss", {
        "disable_gradient_checkpointing": contextlib.nullcontext, "is_peft_model": lambda m: False})
    answers = chosen_token_logps + rejected_token_logps
    prompt = 3  # tokens before each answer; TRL's completion_mask marks the answer tokens
    length = prompt + max(len(a) for a in answers)
    completion_mask = torch.zeros(len(answers), length, dtype=torch.long)
    log_probs = torch.zeros(len(answers), length - 1, dtype=torch.float64)
    for row, answer in enumerate(answers):
        completion_mask[row, prompt:prompt + len(answer)] = 1
        log_probs[row, prompt - 1:prompt - 1 + len(answer)] = answer  # position t predicts token t + 1

    def model(**kwargs):  # the fused LM head's outputs: answer tokens' log-probs, 0 where labels are ignored
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=loss_types,
        loss_weights=loss_weights or [1.0] * len(loss_types), beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    inputs = {"input_ids": torch.zeros(len(answers), length, dtype=torch.long),
              "attention_mask": torch.ones(len(answers), length, dtype=torch.long),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = compute(trainer, model, inputs, return_outputs=False)
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def trl_cpo_loss(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float, loss_type: str,
                 simpo_gamma: float = 0.5):
    """TRL ``CPOTrainer.cpo_loss`` (``alpha=0``: no AlphaPO transform, ``label_smoothing=0``) on the log-probs it
    is given: averaged per answer token for ``simpo``, as its ``concatenated_forward`` makes them."""
    cpo_loss = trl_function("experimental/cpo/cpo_trainer.py", "CPOTrainer.cpo_loss", {})
    trainer = SimpleNamespace(alpha=0.0, beta=beta, simpo_gamma=simpo_gamma, label_smoothing=0.0,
                              loss_type=loss_type, accelerator=_accelerator())
    return cpo_loss(trainer, chosen_avg, rejected_avg)


def trl_odds_ratio_loss(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, beta: float):
    """TRL ``ORPOTrainer.odds_ratio_loss`` on log-probs averaged per answer token (as ORPO's forward makes them)."""
    log1mexp = trl_function("experimental/orpo/orpo_trainer.py", "log1mexp", {})
    odds_ratio_loss = trl_function("experimental/orpo/orpo_trainer.py", "ORPOTrainer.odds_ratio_loss",
                                   {"log1mexp": log1mexp})
    trainer = SimpleNamespace(beta=beta, accelerator=_accelerator())
    return odds_ratio_loss(trainer, chosen_avg, rejected_avg)
