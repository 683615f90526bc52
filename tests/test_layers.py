"""The architecture as the folder names promise it: the packages form layers that import one way only (`common/`
the ground floor, `build.py` between the runners and the apps), no import circle runs through any module (imports
inside functions and under `TYPE_CHECKING` count), only the DeepSpeed engine's package (plus the registration of
engines and the launcher glue) knows DeepSpeed, and the export library imports no command-line module."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lavis_ds"
ABOVE_COMMON = ("lavis_ds.models", "lavis_ds.datasets", "lavis_ds.runners", "lavis_ds.processors", "lavis_ds.metrics",
                "lavis_ds.optim", "lavis_ds.config", "lavis_ds.build", "lavis_ds.apps")
# Where the word may stand: the engine's own package, the package that registers the engines and names the
# default one, and the launcher glue: the process-group set-up that also serves the `deepspeed` launcher, the
# GPU binding whose messages name that launcher's --num_gpus, and the train command, which takes its --local_rank.
KNOWS_DEEPSPEED = {"runners/deepspeed", "runners/__init__.py", "common/dist.py", "common/device.py", "train.py",
                   # not DeepSpeed itself: MiniGPT4Qwen's task name `deepspeed_image_text_pretrain`, an alias of sft
                   "objectives/sft.py"}


# The export library: what `export.py` and the apps call to read checkpoints and write exports. Leaf modules:
# they import no other lavis_ds.apps module (no command line: export, generate, chat, webui, nor generation).
EXPORT_LIBRARY = {"lavis_ds.apps.export_io", "lavis_ds.apps.export_hf", "lavis_ds.apps.export_hf_checks",
                  "lavis_ds.apps.export_hf_processor", "lavis_ds.apps.export_hf_readme"}


# The package's layers, bottom first: a module imports modules of its own layer or of layers below it, never above
# (names are lavis_ds's subpackages and top-level modules). The commands (`train`, `show_sample`) and the
# apps sit on `build` and `config`; the package's `__init__` registers every family, above the runners.
LAYERS = (
    ("common",),
    ("processors", "metrics", "optim", "run_checks"),
    ("models",),
    ("datasets",),
    ("objectives", "image_config"),
    ("runners",),
    ("lavis_ds", "build", "config"),
    ("apps", "train", "show_sample"),
    ("cli", "chat", "export", "generate", "webui"),  # the command line; the old module paths point at it
)


def import_statements(path: Path, package: str | None = None) -> list[tuple[str, list[str]]]:
    """``(module, the names imported from it)`` for every import statement in ``path``, at module level, inside a
    function or under ``TYPE_CHECKING`` (a lazy import is a dependency too; ``import a.b``: ``("a.b", [])``).
    ``package``: the file's own package, to resolve relative imports (left out: relative imports are skipped)."""
    statements = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            statements.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module
            elif package is None:
                continue
            else:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            if module:
                statements.append((module, [alias.name for alias in node.names]))
    return statements


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every name an import statement in ``path`` names (:func:`import_statements`): ``a.b`` and, for
    ``from a.b import c``, also ``a.b.c``."""
    return {name for module, names in import_statements(path, package)
            for name in (module, *(f"{module}.{name}" for name in names))}


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: the modules of root's package it imports}`` for every ``.py`` under ``root``, ``package``'s
    folder. ``from a import b`` where ``a.b`` is a module depends on ``a.b``, not on ``a``'s ``__init__`` (which
    Python runs first, but whose names it does not use)."""
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join([package, *parts])] = path
    graph = {}
    for module, path in files.items():
        own = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for target, names in import_statements(path, own):
            submodules = {f"{target}.{name}" for name in names} & files.keys()
            targets |= submodules
            if len(submodules) < len(names) or not names:  # a name the package's __init__ defines, or `import a`
                targets.add(target)
        graph[module] = {name for name in targets if name in files and name != module}
    return graph


def layer_violations(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> dict[str, list[str]]:
    """``{module: the modules of higher layers it imports}``; a module's layer is that of its top-level name
    (``pkg.runners.trainer``: ``runners``; ``pkg`` itself: ``pkg``)."""
    level = {name: number for number, names in enumerate(layers) for name in names}

    def layer_of(module: str) -> int:
        parts = module.split(".")
        return level[parts[1] if len(parts) > 1 else parts[0]]

    found = {module: sorted(t for t in targets if layer_of(t) > layer_of(module)) for module, targets in graph.items()}
    return {module: targets for module, targets in found.items() if targets}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: one per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_lavis_ds_has_no_import_cycle():
    graph = module_graph(PACKAGE, "lavis_ds")
    # the walk sees what it checks: a lazy import inside a function, one under TYPE_CHECKING, build.py's own
    assert "lavis_ds.build" in graph["lavis_ds.apps.export_io"]  # inside load_exported
    assert "lavis_ds.runners.engine" in graph["lavis_ds.runners.resume"]  # under TYPE_CHECKING
    assert "lavis_ds.models.export_folder" in graph["lavis_ds.build"]
    assert import_cycles(graph) == []


def test_every_module_imports_only_its_layer_and_those_below():
    graph = module_graph(PACKAGE, "lavis_ds")
    named = {module.split(".")[1] if "." in module else module for module in graph}
    assert named == {name for layer in LAYERS for name in layer}  # a new top-level module is given its layer
    assert layer_violations(graph, LAYERS) == {}


def test_the_checks_find_a_cycle_and_an_upward_import_through_lazy_relative_and_type_hint_imports(tmp_path):
    package = tmp_path / "toy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("from toy.library import run\n")
    (package / "library.py").write_text("from . import helpers\n")
    (package / "helpers.py").write_text("def go():\n    from toy import cli  # lazy: a dependency all the same\n")
    (package / "leaf.py").write_text("import toy.helpers\n")
    graph = module_graph(package, "toy")
    assert graph["toy.library"] == {"toy.helpers"} and graph["toy.helpers"] == {"toy.cli"}
    assert import_cycles(graph) == [["toy.cli", "toy.helpers", "toy.library"]]
    # the layers (helpers and leaf below cli and library) see the same upward import, and only it
    layers = (("toy", "helpers", "leaf"), ("cli", "library"))
    assert layer_violations(graph, layers) == {"toy.helpers": ["toy.cli"]}
    (package / "helpers.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.cli import X\n")
    assert import_cycles(module_graph(package, "toy")) == [["toy.cli", "toy.helpers", "toy.library"]]  # a type hint's
    (package / "helpers.py").write_text("def go():\n    return 1\n")
    assert import_cycles(module_graph(package, "toy")) == [] and layer_violations(module_graph(package, "toy"), layers) == {}


def test_the_export_library_imports_no_command_line_module():
    graph = module_graph(PACKAGE / "apps", "lavis_ds.apps")
    assert EXPORT_LIBRARY <= graph.keys()
    outside = {module: sorted(graph[module] - EXPORT_LIBRARY - {"lavis_ds.apps"}) for module in EXPORT_LIBRARY}
    assert {module: names for module, names in outside.items() if names} == {}
    assert "lavis_ds.apps.export_io" in graph["lavis_ds.apps.export_hf"]  # the walk sees the library's own imports


def test_common_imports_nothing_above_it():
    offenders = {str(path.relative_to(PACKAGE)): sorted(name for name in imported_modules(path)
                                                         if name.startswith(ABOVE_COMMON))
                 for path in (PACKAGE / "common").rglob("*.py")}
    assert not {path: names for path, names in offenders.items() if names}


def test_only_the_deepspeed_engine_and_the_launcher_glue_know_deepspeed():
    """The issue's check, `grep -rln deepspeed lavis_ds`, as a test (code, config keys and docstrings alike)."""
    knowing = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*")
                     if path.is_file() and path.suffix in (".py", ".yaml") and "deepspeed" in path.read_text())
    assert knowing, "the DeepSpeed engine itself must be found: the scan is broken"
    assert [path for path in knowing if not path.startswith(tuple(KNOWS_DEEPSPEED))] == []


def test_no_module_outside_the_deepspeed_engine_imports_deepspeed():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        relative = str(path.relative_to(PACKAGE))
        if relative.startswith("runners/deepspeed/"):
            continue
        names = sorted(name for name in imported_modules(path)
                       if name.split(".")[0] == "deepspeed" or "integrations.deepspeed" in name
                       or name.endswith("deepspeed_zero3_enabled"))
        if names:
            offenders[relative] = names
    assert offenders == {}
