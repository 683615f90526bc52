"""Split trainable parameters into weight-decay / no-decay groups with per-group lr scales."""
from __future__ import annotations

import logging

from torch import nn

from lavis_ds.common import dist
from lavis_ds.common.errors import ConfigError
from lavis_ds.common.renamed_keys import renamed, renamed_keys
from lavis_ds.common.suggest import did_you_mean

logger = logging.getLogger(__name__)


def _no_decay(name: str, ndim: int) -> bool:
    # Biases, norms and 1-d tensors (LayerNorm weights, q/v biases) are not decayed, as in LAVIS.
    return ndim < 2 or name.endswith(".bias") or ".ln" in name or "norm" in name


def build_param_groups(model: nn.Module, weight_decay: float, lr_scales: dict[str, float] | None = None) -> list[dict]:
    """Trainable parameters only (frozen ones never reach the optimizer).

    ``lr_scales`` maps a parameter-name prefix (e.g. ``"llm_proj"``) to a factor on
    the scheduled learning rate; the longest matching prefix wins. Each group keeps
    its ``lr_scale`` so the scheduler can apply it. A prefix under a name the model's parameters had before
    (``RENAMED_KEYS``: blip2_qwen's ``llm_proj``) scales the parameters it names today.
    """
    renames = getattr(model, "RENAMED_KEYS", ())
    spelled = {renamed(prefix, renames): prefix for prefix in lr_scales or {}}  # messages name the user's key
    lr_scales = renamed_keys(lr_scales or {}, renames)
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
    _check_prefixes(model, set(lr_scales) - used, trainable, spelled)
    # "names" is for humans reading a debugger; optimizers do not want it.
    return [{k: v for k, v in g.items() if k != "names"} for g in groups.values()]


def _check_prefixes(model: nn.Module, unmatched: set[str], trainable: list[str], spelled: dict[str, str]) -> None:
    """A prefix that names no parameter at all is a typo, which would train with other learning rates than asked:
    a ConfigError, as an unknown key is. One that names only frozen parameters is said once (a shared YAML whose
    freeze_* switches changed)."""
    names = [name for name, _ in model.named_parameters()]
    prefixes = {".".join(name.split(".")[:depth]) for name in names for depth in range(1, name.count(".") + 2)}
    prefixes |= {old.rstrip(".") for old, _ in getattr(model, "RENAMED_KEYS", ())}  # the names it still reads
    typos = sorted(prefix for prefix in unmatched if not any(name.startswith(prefix) for name in names))
    if typos:
        parts = ", ".join(sorted({name.split(".")[0] for name in trainable}))  # the model's trainable top-level parts
        raise ConfigError([f"run.lr_scales.{spelled[prefix]}: matches no parameter of the model; "
                           f"{did_you_mean(spelled[prefix], prefixes, f'trainable parameter names start with {parts}')}"
                           for prefix in typos], "run.lr_scales")
    for prefix in sorted(unmatched - set(typos)) if dist.is_main_process() else []:  # every rank builds groups
        logger.warning("run.lr_scales.%s: the prefix names only frozen parameters, so this factor has no effect",
                       spelled[prefix])
