"""Check a config section against the typed signature of the class it configures.

A component's valid keys and their types are its constructor's keyword arguments
(or a dataclass's fields), so the schema can never drift from the code. Every
problem is collected, not raised, so a user sees all of them at once.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from typing import Any, Literal, Union

_NO_DEFAULT = inspect.Parameter.empty


def fields_of(target: Any) -> dict[str, tuple[Any, Any]]:
    """``{name: (type, default)}`` of a dataclass or of a callable's keyword arguments."""
    if dataclasses.is_dataclass(target):
        hints = typing.get_type_hints(target)
        out = {}
        for f in dataclasses.fields(target):
            default = f.default
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            out[f.name] = (hints[f.name], _NO_DEFAULT if default is dataclasses.MISSING else default)
        return out
    func = target.__init__ if inspect.isclass(target) else target
    hints = typing.get_type_hints(func)
    out = {}
    for name, p in inspect.signature(func).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[name] = (hints.get(name, Any), p.default)
    return out


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def matches(value: Any, tp: Any) -> bool:
    """Whether a plain (YAML-loaded) value fits the annotation ``tp``."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return value in args
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


def unknown_key_message(path: str, key: str, valid: typing.Iterable[str]) -> str:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
    return f"{path}.{key}: unknown key; {hint}"


def check_section(section: dict, schema: dict[str, tuple[Any, Any]], path: str, errors: list[str],
                  extra_keys: typing.Iterable[str] = ()) -> None:
    """Append to ``errors`` every unknown key, wrong type and missing required key."""
    extra = set(extra_keys)
    for key, value in section.items():
        if key in extra:
            continue
        if key not in schema:
            errors.append(unknown_key_message(path, key, set(schema) | extra))
        elif not matches(value, schema[key][0]):
            errors.append(f"{path}.{key}: expected {type_name(schema[key][0])}, got {value!r}")
    for key, (_, default) in schema.items():
        if default is _NO_DEFAULT and key not in section:
            errors.append(f"{path}.{key}: required key is missing")
