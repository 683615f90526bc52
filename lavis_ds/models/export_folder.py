"""A ``--format lavis_ds`` export folder as the model layer reads it: its two files, its config, and its trained
weights copied into a built model with strict accounting.

``lavis_ds.build`` reads it for ``model.pretrained`` naming an export (a preference run starting from an SFT
run); the export library (``lavis_ds.apps.export_io``) writes and loads such folders through it. It imports
nothing above the models, so the build imports no app.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.common.errors import InputError
from lavis_ds.common.renamed_keys import renamed_keys

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"


class ExportError(InputError, ValueError):
    """A checkpoint that cannot be exported or an export that cannot be loaded; the message names the path."""


def is_export(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return (folder / WEIGHTS_FILE).is_file() and (folder / CONFIG_FILE).is_file()


def read_export_config(folder: str | os.PathLike) -> DictConfig:
    """``config.yaml`` of an export folder; a clear error if ``folder`` is not one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not an export folder (it does not exist)")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise ExportError(f"{folder} is not an export folder: {' and '.join(missing)} missing "
                          "(make one with `lavis-ds export <checkpoint or run dir> --out <folder>`)")
    cfg = OmegaConf.load(folder / CONFIG_FILE)
    absent = [key for key in ("model", "seed", "export") if key not in cfg]
    if absent:
        raise ExportError(f"{folder / CONFIG_FILE}: key(s) {', '.join(absent)} missing; not written by lavis_ds export")
    return cfg


def load_trained_weights(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``weights`` into ``model``'s parameters, with strict accounting.

    Every key must name a parameter of ``model`` (trainable or not) of the same shape,
    and every trainable parameter must be in ``weights``; otherwise :class:`ExportError`
    lists the offending names. Frozen parameters not in ``weights`` keep the values the
    model was built with. A key under a name the architecture's parameters had in files it wrote earlier
    (``RENAMED_KEYS``: blip2_qwen's ``visual_encoder.*``, ...) is read under today's name.
    """
    weights = renamed_keys(weights, getattr(model, "RENAMED_KEYS", ()))
    present = dict(model.named_parameters(remove_duplicate=False))  # a tied alias is a present name too
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    problems = []
    unknown = sorted(set(weights) - set(present))
    if unknown:
        problems.append(f"{len(unknown)} key(s) name no parameter of the rebuilt {type(model).__name__}: "
                        + _names(unknown))
    missing = [name for name in trainable if name not in weights]
    if missing:
        problems.append(f"{len(missing)} trainable parameter(s) are not in the file (they would keep their "
                        f"initial values): {_names(missing)}")
    shapes = [f"{name} {tuple(weights[name].shape)} vs {tuple(present[name].shape)}"
              for name in weights if name in present and weights[name].shape != present[name].shape]
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es) (file vs model): {_names(shapes)}")
    if problems:
        raise ExportError(f"{source} does not fit the model built from its config:\n  - " + "\n  - ".join(problems)
                          + "\nThe weights and config.yaml must come from one export (was either edited or replaced?)")
    with torch.no_grad():
        for name, tensor in weights.items():
            present[name].copy_(tensor)  # into the parameter's own dtype and device


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
