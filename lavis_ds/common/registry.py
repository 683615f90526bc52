"""Name -> class registries: the only global mutable state in lavis_ds.

One :class:`Registry` per kind of component, the one API lavis_ds uses: register with its decorator
(``@reg.models.register("name")`` after ``from lavis_ds.common import registry as reg``),
look up with ``get``. Unknown names raise a ``KeyError`` that lists the known
names and suggests the closest; duplicates raise and name the first owner.
An alias (``register_alias``) is a second name for a registered entry: other
frameworks' YAMLs (LAVIS, MiniGPT4Qwen) keep their spelling and get the same class.
LAVIS users keep their spelling: ``registry.register_model("name")`` and
``registry.get_model_class("name")`` are thin aliases of the same calls (``_LavisStyle``).
"""
from __future__ import annotations

from typing import Callable, Iterator, TypeVar

from lavis_ds.common import suggest

T = TypeVar("T")


class Registry:
    """A named mapping from strings to classes (or factory functions)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, object] = {}
        self._aliases: dict[str, str] = {}  # alias -> registered name

    def _check_free(self, name: str, newcomer: str) -> None:
        """Raise if ``name`` is taken, by an entry or by an alias, naming who has it."""
        if name in self._entries:
            raise KeyError(f"{self.kind} name {name!r} is already registered by "
                           f"{_owner(self._entries[name])}; pick another name for {newcomer}")
        if name in self._aliases:
            raise KeyError(f"{self.kind} name {name!r} is already an alias of {self._aliases[name]!r}; "
                           f"pick another name for {newcomer}")

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@models.register("blip2_qwen")``."""

        def add(obj: T) -> T:
            self._check_free(name, _owner(obj))
            self._entries[name] = obj
            return obj

        return add

    def register_alias(self, alias: str, name: str) -> None:
        """Make ``alias`` resolve to the entry registered as ``name`` (which must exist)."""
        if name not in self._entries:
            raise KeyError(f"cannot alias {alias!r} to {name!r}: no {self.kind} is registered as {name!r}")
        self._check_free(alias, f"the alias of {name!r}")
        self._aliases[alias] = name

    def canonical(self, name: str) -> str:
        """The registered name behind ``name`` (itself unless it is an alias); unknown names raise like ``get``."""
        self.get(name)
        return self._aliases.get(name, name)

    def aliases(self) -> dict[str, str]:
        """``{alias: registered name}``."""
        return dict(sorted(self._aliases.items()))

    def get(self, name: str):
        if name in self._aliases:
            return self._entries[self._aliases[name]]
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self._unknown_message(name)) from None

    def closest(self, name: str) -> str | None:
        """The known name (or alias) most like ``name``, if any is close."""
        close = suggest.closest(name, [*self._entries, *self._aliases])
        return close[0] if close else None

    def _unknown_message(self, name: str) -> str:
        hint = suggest.did_you_mean(name, [*self._entries, *self._aliases], sentence=True)
        hint = f" {hint}" if hint else ""
        aliases = "".join(f", {alias} (= {target})" for alias, target in self.aliases().items())
        return (f"Unknown {self.kind} {name!r}.{hint} Known {self.kind}s: "
                f"{', '.join(sorted(self._entries)) or '(none)'}{aliases}. To add your own, "
                f"register it and list its module under `imports:` in the YAML.")

    def distinct(self) -> dict[str, object]:
        """``{name: entry}`` with every entry once, under the first name (in sorted order) it is registered as."""
        first: dict[int, str] = {}
        for name in self:
            first.setdefault(id(self._entries[name]), name)
        return {name: self._entries[name] for name in first.values()}

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        """Registered names only (an alias is not a second entry)."""
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        aliases = "".join(f", {alias} -> {target}" for alias, target in self.aliases().items())
        return f"Registry({self.kind!r}: {', '.join(self)}{aliases})"


def _owner(obj: object) -> str:
    """Where a registered entry comes from: a class or function by its qualified name, an instance (a family
    record) by its class's."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{named.__module__}.{named.__qualname__}"


models = Registry("model")
builders = Registry("dataset builder")
processors = Registry("processor")
lr_schedulers = Registry("lr scheduler")
# Engine classes (DeepSpeed, FSDP, a user's own); `run.runner` names one. `runners` is LAVIS's name for this
# registry: user modules that register with it keep working.
engines = Registry("engine")
runners = engines
metrics = Registry("metric")
hooks = Registry("hook")
# Training objectives; LAVIS calls them tasks (`run.task`).
objectives = Registry("objective")
# Parts that composed architectures are built from (lavis_ds.models.towers, lavis_ds.models.connectors).
vision_towers = Registry("vision tower")
connectors = Registry("connector")
# transformers vision-LLM classes (LlavaForConditionalGeneration, ...): how lavis_ds exports to each and reads its
# published folders back (lavis_ds.models.hf). Entries are family records (HfFamily instances); each names the
# config.json model_type its folders carry.
hf_families = Registry("Hugging Face family")
# How an LLM family numbers its tokens (lavis_ds.models.positions; the family table in models.llm_families).
position_providers = Registry("position provider")


class _LavisStyle:
    """The LAVIS spelling (``registry.register_model``) over the registries above."""

    register_model = staticmethod(models.register)
    register_builder = staticmethod(builders.register)
    register_processor = staticmethod(processors.register)
    register_lr_scheduler = staticmethod(lr_schedulers.register)
    register_engine = staticmethod(engines.register)
    register_runner = staticmethod(engines.register)  # LAVIS's name for an engine class
    register_metric = staticmethod(metrics.register)
    register_hook = staticmethod(hooks.register)
    get_model_class = staticmethod(models.get)
    get_builder_class = staticmethod(builders.get)
    get_processor_class = staticmethod(processors.get)
    get_lr_scheduler_class = staticmethod(lr_schedulers.get)
    get_engine_class = staticmethod(engines.get)
    get_runner_class = staticmethod(engines.get)
    register_model_alias = staticmethod(models.register_alias)
    register_builder_alias = staticmethod(builders.register_alias)
    register_processor_alias = staticmethod(processors.register_alias)
    register_engine_alias = staticmethod(engines.register_alias)
    register_runner_alias = staticmethod(engines.register_alias)
    get_metric_class = staticmethod(metrics.get)
    get_hook_class = staticmethod(hooks.get)
    register_hook_alias = staticmethod(hooks.register_alias)
    register_objective = staticmethod(objectives.register)
    register_task = staticmethod(objectives.register)  # LAVIS's name for an objective
    get_objective_class = staticmethod(objectives.get)
    get_task_class = staticmethod(objectives.get)
    register_objective_alias = staticmethod(objectives.register_alias)
    register_task_alias = staticmethod(objectives.register_alias)
    register_vision_tower = staticmethod(vision_towers.register)
    register_connector = staticmethod(connectors.register)
    get_vision_tower_class = staticmethod(vision_towers.get)
    get_connector_class = staticmethod(connectors.get)


registry = _LavisStyle()
