"""What every processor shares: being built from one config section."""
from __future__ import annotations

from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from lavis_ds.common.schema import fields_of
from lavis_ds.common.suggest import did_you_mean


class BaseProcessor:
    """A callable data transform whose constructor takes plain keyword arguments.

    Subclasses only write ``__init__`` (keyword-only, typed, with defaults: the
    config validator reads the valid keys from that signature) and ``__call__``.
    """

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DictConfig | None = None):
        """Build from a section like ``{name: blip2_image_eval, image_size: 224}``.

        ``name`` selects the class in the registry and is dropped here; every other
        key must be a constructor argument.
        """
        if cfg is None:
            return cls()
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        if not isinstance(cfg, Mapping):
            raise TypeError(f"{cls.__name__}.from_config expects a mapping, got {type(cfg).__name__}: {cfg!r}")
        kwargs = {str(k): v for k, v in cfg.items() if k != "name"}
        valid = constructor_keys(cls)
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            hints = [f"{key!r} ({did_you_mean(key, valid)})" if did_you_mean(key, valid) else repr(key)
                     for key in unknown]
            raise ValueError(
                f"{cls.__name__}: unknown config key(s) {', '.join(hints)}; "
                f"valid keys: {', '.join(valid) or '(none)'}"
            )
        return cls(**kwargs)

    def __call__(self, item: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in constructor_keys(type(self)) if hasattr(self, k))
        return f"{type(self).__name__}({args})"


def constructor_keys(cls: type) -> list[str]:
    """The keyword arguments ``cls.__init__`` accepts (its config keys), through ``**kwargs`` up the MRO."""
    return list(fields_of(cls))
