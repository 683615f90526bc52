"""What a class of lavis_ds looks like from outside: how many public members it answers for, and which attributes
its methods set that no constructor declares. Shared by ``test_class_shape.py`` (every class of ``lavis_ds.models``
and ``lavis_ds.runners``) and ``test_runner_parts.py`` (the loop's and the engines' classes, the tests' engines
included).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import sys
from functools import cache
from pathlib import Path

CONSTRUCTOR = "__init__"


def self_attributes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The attributes ``function`` sets on ``self``: ``self.x = ...``, ``self.x: T = ...``, ``self.x += ...``,
    ``self.x, self.y = ...`` (and starred or nested unpacking), ``with ... as self.x``, ``for self.x in ...``,
    ``setattr(self, "x", ...)``; nested functions' included (a closure that sets ``self.x`` sets it too)."""
    found = set()
    for node in ast.walk(function):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets = [node.optional_vars]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and _is_self(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            found.add(node.args[1].value)
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and _is_self(leaf.value):
                    found.add(leaf.attr)
    return found


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


class ClassSource:
    """One class statement: the names its body and its constructor declare, whether that constructor runs its
    bases' (``chains_up``), and what each other method sets."""

    def __init__(self, node: ast.ClassDef):
        methods = [item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
        constructor = next((method for method in methods if method.name == CONSTRUCTOR), None)
        # A class-level value declares a name; a bare annotation (``prompt: ChatPrompt``) only types one that
        # something else sets (a dataclass's generated constructor: ``late_attributes``).
        self.class_level = {target.id for item in node.body if isinstance(item, ast.Assign)
                            for target in item.targets if isinstance(target, ast.Name)}
        self.class_level |= {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
                             and item.value is not None and isinstance(item.target, ast.Name)}
        self.constructed = self_attributes(constructor) if constructor is not None else set()
        self.declared = self.class_level | self.constructed
        # No constructor of its own, or one that calls another's (``super().__init__(...)``, ``Base.__init__``).
        self.chains_up = constructor is None or any(
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == CONSTRUCTOR
            for node in ast.walk(constructor))
        self.set_by = {method.name: self_attributes(method) for method in methods if method.name != CONSTRUCTOR}


@cache
def class_sources(path: Path) -> dict[str, ClassSource]:
    """Every class statement of a source file by its qualified name (``Outer.Inner`` for a nested one)."""
    found: dict[str, ClassSource] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[prefix + node.name] = ClassSource(node)
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(path.read_text()).body, "")
    return found


def source_of(cls: type) -> ClassSource | None:
    """``cls``'s class statement, if its module is a Python source file."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if path is None or not path.endswith(".py"):
        return None
    return class_sources(Path(path)).get(cls.__qualname__)


def late_attributes(cls: type, package: str = "lavis_ds") -> dict[str, str]:
    """``{attribute: the method that sets it}`` for what a method of ``cls``'s own statement sets on ``self`` that
    neither a constructor nor a class body of its classes declares. Its bases are followed: those of ``package``
    through their source (class-level values, and constructors that run: up to one that calls no other's; annotations only where a generated constructor sets
    them, a dataclass's or a NamedTuple's), any class's class attributes and descriptors, and a library class's
    annotations (``nn.Module.training``: torch's constructor sets them) through the class itself."""
    own = source_of(cls)
    if own is None:
        return {}
    declared, constructors_run = set(), True
    for base in cls.__mro__:
        source = source_of(base) if base.__module__.split(".")[0] == package else None
        declared |= set(vars(base))
        if source is not None:
            declared |= source.class_level | (source.constructed if constructors_run else set())
            constructors_run = constructors_run and source.chains_up  # past a constructor that skips its bases'
        if source is None or dataclasses.is_dataclass(base) or hasattr(base, "_fields"):
            declared |= set(vars(base).get("__annotations__", {}))
    late: dict[str, str] = {}
    for method, attrs in own.set_by.items():  # in source order: the first method that sets it is named
        for attr in sorted(attrs - declared):
            late.setdefault(attr, method)
    return late


def public_members(cls: type, package: str = "lavis_ds") -> set[str]:
    """The public names ``cls`` answers for: class attributes, methods, properties and annotations of every class of
    ``package`` in its MRO (UPPERCASE constants included; torch's and Python's own members not counted)."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == package:
            names |= {name for name in (*vars(base), *vars(base).get("__annotations__", {}))
                      if not name.startswith("_")}
    return names


def package_classes(*packages: str) -> dict[str, type]:
    """Every class defined in a module of ``packages`` (``lavis_ds.models``, ..., or a plain module) by
    ``module.Class``, every module imported (one that fails to import fails here: no class goes unchecked)."""
    found = {}
    for package in packages:
        root = importlib.import_module(package)
        inside = pkgutil.walk_packages(root.__path__, package + ".") if hasattr(root, "__path__") else ()
        modules = [package, *(info.name for info in inside)]
        for name in modules:
            module = importlib.import_module(name)
            found.update({f"{name}.{cls.__qualname__}": cls for cls in vars(module).values()
                          if inspect.isclass(cls) and cls.__module__ == name})
    return found
