"""Check a config section against the typed signature of the class it configures.

A component's valid keys and their types are its constructor's keyword arguments
(or a dataclass's fields), so the schema can never drift from the code. A number
that must lie in a range says so in its annotation, ``Annotated[int, Range(ge=1)]``,
and the checker reports a value outside it. Every problem is collected, not
raised, so a user sees all of them at once.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Annotated, Any, Literal, Union

from lavis_ds.common.suggest import did_you_mean

_NO_DEFAULT = inspect.Parameter.empty


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a number-valued key, as ``Annotated[int, Range(ge=1)]``; ``None`` values are not checked."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of range, or None."""
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if ok else f"{value!r} is out of range; valid: {self}"

    def __str__(self) -> str:
        bounds = [f"{op} {bound}" for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                  if bound is not None]
        return " and ".join(bounds)


def _strip_annotated(tp: Any) -> tuple[Any, list[Range]]:
    """``(type, [Range, ...])`` of a possibly ``Annotated`` annotation."""
    if typing.get_origin(tp) is Annotated:
        base, *extras = typing.get_args(tp)
        return base, [e for e in extras if isinstance(e, Range)]
    return tp, []


def fields_of(target: Any) -> dict[str, tuple[Any, Any]]:
    """``{name: (type, default)}`` of a dataclass or of a callable's keyword arguments.

    A class whose ``__init__`` forwards ``**kwargs`` (the usual ``super().__init__(*args, **kwargs)``
    subclass) also takes what the next ``__init__`` up its MRO takes, and so on until a constructor
    without ``**kwargs``: the keys of the whole chain, each class's own annotation and default first.
    """
    if dataclasses.is_dataclass(target):
        try:
            hints = typing.get_type_hints(target, include_extras=True)
        except Exception:  # a library's annotation naming what its module never imports: no type check for it
            hints = {}
        out = {}
        for f in dataclasses.fields(target):
            default = f.default
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            out[f.name] = (hints.get(f.name, Any), _NO_DEFAULT if default is dataclasses.MISSING else default)
        return out
    if not inspect.isclass(target):
        return _own_fields(target)[0]
    out: dict[str, tuple[Any, Any]] = {}
    for cls in target.__mro__:
        if "__init__" not in vars(cls) or cls is object:
            continue  # inherits the next class's constructor: that one is read in its turn
        own, forwards = _own_fields(vars(cls)["__init__"])
        for name, field in own.items():
            out.setdefault(name, field)
        if not forwards:
            break
    return out


def _own_fields(func: Any) -> tuple[dict[str, tuple[Any, Any]], bool]:
    """A function's keyword arguments, and whether it takes ``**kwargs`` (forwards them, presumably)."""
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception:  # an annotation that does not resolve (a user's forward reference): no type check for it
        hints = {}
    out = {}
    forwards = False
    for name, p in inspect.signature(func).parameters.items():
        if p.kind is p.VAR_KEYWORD:
            forwards = True
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        out[name] = (hints.get(name, Any), p.default)
    return out, forwards


def type_name(tp: Any) -> str:
    tp, _ = _strip_annotated(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join("null" if a is None else repr(a) for a in typing.get_args(tp))  # YAML spells None null
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def matches(value: Any, tp: Any) -> bool:
    """Whether a plain (YAML-loaded) value fits the annotation ``tp`` (ranges aside: see ``range_problem``)."""
    tp, _ = _strip_annotated(tp)
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:  # true is not 1, nor false 0 (a ZeRO stage)
        return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in args)
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:  # YAML writes 1e-4 as a float but 1 as an int; both are fine numbers
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(matches(v, args[0]) for v in value) if args else isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict) and (not args or all(matches(v, args[1]) for v in value.values()))
    if inspect.isclass(tp):
        return isinstance(value, tp)
    return True


def range_problem(value: Any, tp: Any) -> str | None:
    """Why ``value`` is outside the ``Range`` of annotation ``tp``, or None."""
    for bounds in _strip_annotated(tp)[1]:
        problem = bounds.problem(value)
        if problem:
            return problem
    return None


def unknown_key_message(path: str, key: str, valid: typing.Iterable[str]) -> str:
    valid = sorted(valid)
    return f"{path}.{key}: unknown key; {did_you_mean(key, valid, 'valid keys: ' + ', '.join(valid))}"


def check_section(section: dict, schema: dict[str, tuple[Any, Any]], path: str, errors: list[str],
                  extra_keys: typing.Iterable[str] = (), require: bool = True) -> None:
    """Append to ``errors`` every unknown key, wrong type, value out of range and (``require``) missing
    required key."""
    extra = set(extra_keys)
    for key, value in section.items():
        if key in extra:
            continue
        if key not in schema:
            errors.append(unknown_key_message(path, key, set(schema) | extra))
        elif not matches(value, schema[key][0]):
            errors.append(f"{path}.{key}: expected {type_name(schema[key][0])}, got {value!r}")
        elif range_problem(value, schema[key][0]):
            errors.append(f"{path}.{key}: {range_problem(value, schema[key][0])}")
    for key, (_, default) in schema.items():
        if require and default is _NO_DEFAULT and key not in section:
            errors.append(f"{path}.{key}: required key is missing")
