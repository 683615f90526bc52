"""Name -> class registries: the only global mutable state in lavis_ds.

One :class:`Registry` per kind of component. Register with a decorator,
look up with ``get``. Unknown names raise a ``KeyError`` that lists the known
names and suggests the closest; duplicates raise and name the first owner.
LAVIS users keep their spelling: ``registry.register_model("name")`` and
``registry.get_model_class("name")`` work as they did there.
"""
from __future__ import annotations

import difflib
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


class Registry:
    """A named mapping from strings to classes (or factory functions)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, object] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@models.register("blip2_qwen")``."""

        def add(obj: T) -> T:
            if name in self._entries:
                first = self._entries[name]
                raise KeyError(
                    f"{self.kind} name {name!r} is already registered by "
                    f"{first.__module__}.{first.__qualname__}; pick another name "
                    f"for {obj.__module__}.{obj.__qualname__}"
                )
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self._entries, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(
                f"Unknown {self.kind} {name!r}.{hint} Known {self.kind}s: "
                f"{', '.join(sorted(self._entries)) or '(none)'}. To add your own, "
                f"register it and list its module under `imports:` in the YAML."
            ) from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self)})"


models = Registry("model")
builders = Registry("dataset builder")
processors = Registry("processor")
lr_schedulers = Registry("lr scheduler")
runners = Registry("runner")
metrics = Registry("metric")


class _LavisStyle:
    """The LAVIS spelling (``registry.register_model``) over the registries above."""

    register_model = staticmethod(models.register)
    register_builder = staticmethod(builders.register)
    register_processor = staticmethod(processors.register)
    register_lr_scheduler = staticmethod(lr_schedulers.register)
    register_runner = staticmethod(runners.register)
    register_metric = staticmethod(metrics.register)
    get_model_class = staticmethod(models.get)
    get_builder_class = staticmethod(builders.get)
    get_processor_class = staticmethod(processors.get)
    get_lr_scheduler_class = staticmethod(lr_schedulers.get)
    get_runner_class = staticmethod(runners.get)
    get_metric_class = staticmethod(metrics.get)


registry = _LavisStyle()
