"""The architecture as the folder names promise it: `common/` is the ground floor, only the DeepSpeed
runner's package (plus the registration of runners and the launcher glue) knows DeepSpeed, `apps/` has no
import cycle, and the export library imports no command-line module."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lavis_ds"
ABOVE_COMMON = ("lavis_ds.models", "lavis_ds.datasets", "lavis_ds.runners", "lavis_ds.processors", "lavis_ds.metrics",
                "lavis_ds.optim", "lavis_ds.config", "lavis_ds.build", "lavis_ds.apps")
# Where the word may stand: the engine's own package, the package that registers the runners and names the
# default one, and the launcher glue: the process-group set-up that also serves the `deepspeed` launcher, the
# GPU binding whose messages name that launcher's --num_gpus, and the train command, which takes its --local_rank.
KNOWS_DEEPSPEED = {"runners/deepspeed", "runners/__init__.py", "common/dist.py", "common/device.py", "train.py",
                   # not DeepSpeed itself: MiniGPT4Qwen's task name `deepspeed_image_text_pretrain`, an alias of sft
                   "objectives/sft.py"}


# The export library: what `export.py` and the apps call to read checkpoints and write exports. Leaf modules:
# they import no other lavis_ds.apps module (no command line: export, generate, chat, webui, nor generation).
EXPORT_LIBRARY = {"lavis_ds.apps.export_io", "lavis_ds.apps.export_hf", "lavis_ds.apps.export_hf_checks",
                  "lavis_ds.apps.export_hf_processor"}


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every name an import statement in ``path`` names, at module level or inside a function (a lazy import is a
    dependency too): ``a.b`` and, for ``from a.b import c``, also ``a.b.c``. ``package``: the file's own package,
    to resolve relative imports (left out: relative imports are skipped)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module
            elif package is None:
                continue
            else:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            if module:
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: the modules of root's package it imports}`` for every ``.py`` under ``root``, ``package``'s
    folder."""
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join([package, *parts])] = path
    graph = {}
    for module, path in files.items():
        own = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph[module] = {name for name in imported_modules(path, own) if name in files and name != module}
    return graph


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


def test_apps_has_no_import_cycle():
    graph = module_graph(PACKAGE / "apps", "lavis_ds.apps")
    assert {"lavis_ds.apps.export", "lavis_ds.apps.export_hf", "lavis_ds.apps.chat"} <= graph.keys()
    assert "lavis_ds.apps.export_io" in graph["lavis_ds.apps.export"]  # the walk sees the imports it checks
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_lazy_and_a_relative_import(tmp_path):
    package = tmp_path / "toy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text("from toy.library import run\n")
    (package / "library.py").write_text("from . import helpers\n")
    (package / "helpers.py").write_text("def go():\n    from toy import cli  # lazy: a dependency all the same\n")
    (package / "leaf.py").write_text("import toy.helpers\n")
    graph = module_graph(package, "toy")
    assert graph["toy.library"] == {"toy", "toy.helpers"} and graph["toy.helpers"] == {"toy", "toy.cli"}
    assert import_cycles(graph) == [["toy.cli", "toy.helpers", "toy.library"]]
    (package / "helpers.py").write_text("def go():\n    return 1\n")
    assert import_cycles(module_graph(package, "toy")) == []


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


def test_only_the_deepspeed_runner_and_the_launcher_glue_know_deepspeed():
    """The issue's check, `grep -rln deepspeed lavis_ds`, as a test (code, config keys and docstrings alike)."""
    knowing = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*")
                     if path.is_file() and path.suffix in (".py", ".yaml") and "deepspeed" in path.read_text())
    assert knowing, "the DeepSpeed runner itself must be found: the scan is broken"
    assert [path for path in knowing if not path.startswith(tuple(KNOWS_DEEPSPEED))] == []


def test_no_module_outside_the_deepspeed_runner_imports_deepspeed():
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
