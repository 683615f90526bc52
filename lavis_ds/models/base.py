"""What every registered model shares: named presets, ``from_config``, frozen parts that stay in eval.

A model's config keys are its constructor's keyword arguments (the config
validator reads them from the signature), so a constructor must take only
keyword-only arguments, each with a default and a plain annotation (int,
float, bool, str, ``X | None``, ``list[X]``, ``dict[str, Any]``,
``Literal[...]``, ``Any``).
"""
from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from torch import nn

logger = logging.getLogger(__name__)

# Presets are package data: they ship inside lavis_ds, never beside a user's project.
CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"

# Keys every `model:` section may hold besides the constructor's arguments.
COMMON_KEYS = ("arch", "model_type", "load_pretrained", "pretrained")


class BaseModel(nn.Module):
    """Base class of registered models.

    Subclasses fill ``PRETRAINED_MODEL_CONFIG_DICT`` (model_type -> YAML path
    relative to ``lavis_ds/configs/``) and take plain keyword arguments.
    """

    PRETRAINED_MODEL_CONFIG_DICT: dict[str, str] = {}

    @classmethod
    def default_config_path(cls, model_type: str) -> Path:
        """Path of the preset YAML for ``model_type``; unknown types raise ``KeyError`` naming the valid ones."""
        presets = cls.PRETRAINED_MODEL_CONFIG_DICT
        if model_type not in presets:
            close = difflib.get_close_matches(str(model_type), presets, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(
                f"Unknown model_type {model_type!r} for {cls.__name__}.{hint} "
                f"Valid model_types: {', '.join(presets) or '(none)'}."
            )
        return CONFIG_ROOT / presets[model_type]

    @classmethod
    def default_config(cls, model_type: str) -> dict[str, Any]:
        """The ``model:`` section of a preset YAML as a plain dict."""
        section = OmegaConf.load(cls.default_config_path(model_type)).model
        return OmegaConf.to_container(section, resolve=True)  # type: ignore[return-value]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DictConfig) -> "BaseModel":
        """Build from an already merged and validated ``model:`` section."""
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        kwargs = dict(cfg)
        common = {key: kwargs.pop(key, None) for key in COMMON_KEYS}
        if common["load_pretrained"]:
            # Loading LAVIS / HF BLIP-2 checkpoints is not implemented yet; say so instead of
            # letting a user believe the random-init vision tower holds pretrained weights.
            logger.warning(
                "%s: load_pretrained is set (pretrained=%r) but checkpoint loading is not "
                "implemented yet; weights that no local folder provides stay randomly initialised.",
                cls.__name__, common["pretrained"],
            )
        return cls(**kwargs)

    def freeze_module(self, name: str) -> None:
        """Freeze submodule ``name`` (dotted path) and keep it in eval mode from now on.

        LAVIS does the same (``disabled_train``): dropout and drop-path of a frozen
        tower would only add noise to the features the trainable parts learn from.
        """
        if not name:
            raise ValueError("freeze_module needs a submodule name; to freeze everything use requires_grad_(False)")
        module = self.get_submodule(name)
        module.requires_grad_(False)
        module.eval()
        # An instance attribute, not a class one: two models in one process never share it.
        self._eval_only = getattr(self, "_eval_only", frozenset()) | {name}

    def train(self, mode: bool = True) -> "BaseModel":
        """Switch mode like ``nn.Module.train``, except that frozen submodules stay in eval."""
        super().train(mode)
        for name in sorted(getattr(self, "_eval_only", ())):
            self.get_submodule(name).eval()
        return self
