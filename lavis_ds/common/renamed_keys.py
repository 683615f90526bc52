"""Parameter names an architecture's files and configs may hold from when its parameters were named otherwise.

A model class lists ``(old prefix, new prefix)`` pairs (``BaseModel.RENAMED_KEYS``: blip2_qwen's MiniGPT4Qwen names
``visual_encoder.*`` -> ``vision_tower.vit.*``, ...); checkpoint keys and ``run.lr_scales`` prefixes written with
the old names are read under the new ones.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

Renames = tuple[tuple[str, str], ...]
V = TypeVar("V")


def renamed(name: str, renames: Renames) -> str:
    """``name`` under its new prefix (an old prefix ``a.`` also renames the bare ``a``); unchanged if none applies."""
    for old, new in renames:
        if name.startswith(old):
            return new + name.removeprefix(old)
        if old.endswith(".") and name == old[:-1]:
            return new[:-1]
    return name


def renamed_keys(mapping: Mapping[str, V], renames: Renames) -> dict[str, V]:
    """``mapping`` with every key :func:`renamed`."""
    return {renamed(key, renames): value for key, value in mapping.items()}
