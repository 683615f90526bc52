"""Split trainable parameters into weight-decay / no-decay groups with per-group lr scales."""
from __future__ import annotations

import logging

from torch import nn

from lavis_ds.common import dist

logger = logging.getLogger(__name__)


def _no_decay(name: str, ndim: int) -> bool:
    # Biases, norms and 1-d tensors (LayerNorm weights, q/v biases) are not decayed, as in LAVIS.
    return ndim < 2 or name.endswith(".bias") or ".ln" in name or "norm" in name


def build_param_groups(model: nn.Module, weight_decay: float, lr_scales: dict[str, float] | None = None) -> list[dict]:
    """Trainable parameters only (frozen ones never reach the optimizer).

    ``lr_scales`` maps a parameter-name prefix (e.g. ``"llm_proj"``) to a factor on
    the scheduled learning rate; the longest matching prefix wins. Each group keeps
    its ``lr_scale`` so the scheduler can apply it.
    """
    lr_scales = lr_scales or {}
    groups: dict[tuple[bool, float], dict] = {}
    used: set[str] = set()
    trainable: list[str] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        trainable.append(name)
        prefix = max((p for p in lr_scales if name.startswith(p)), key=len, default=None)
        if prefix is not None:
            used.add(prefix)
        scale = float(lr_scales[prefix]) if prefix is not None else 1.0
        decay = not _no_decay(name, len(dist.full_shape(param)))  # ZeRO-3 keeps 1-d partitions of any shape
        group = groups.setdefault((decay, scale), {
            "params": [], "names": [], "weight_decay": weight_decay if decay else 0.0, "lr_scale": scale})
        group["params"].append(param)
        group["names"].append(name)
    if not groups:
        raise ValueError("the model has no trainable parameters: check the freeze_* switches in the model config")
    unmatched = sorted(set(lr_scales) - used) if dist.is_main_process() else []  # every rank builds groups
    for prefix in unmatched:  # a typo here would silently train at the base lr
        examples = sorted({name.split(".")[0] for name in trainable})  # the model's top-level parts
        logger.warning("run.lr_scales.%s: the prefix matches no trainable parameter, so this factor has no effect; "
                       "trainable parameter names start with e.g. %s", prefix, ", ".join(examples))
    # "names" is for humans reading a debugger; optimizers do not want it.
    return [{k: v for k, v in g.items() if k != "names"} for g in groups.values()]
