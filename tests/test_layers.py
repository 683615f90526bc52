"""The architecture as the folder names promise it: `common/` is the ground floor, and only the DeepSpeed
runner's package (plus the registration of runners and the launcher glue) knows DeepSpeed."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lavis_ds"
ABOVE_COMMON = ("lavis_ds.models", "lavis_ds.datasets", "lavis_ds.runners", "lavis_ds.processors", "lavis_ds.metrics",
                "lavis_ds.optim", "lavis_ds.config", "lavis_ds.build", "lavis_ds.apps")
# Where the word may stand: the engine's own package, the package that registers the runners and names the
# default one, and the launcher glue: the process-group set-up that also serves the `deepspeed` launcher, the
# GPU binding whose messages name that launcher's --num_gpus, and the train command, which takes its --local_rank.
KNOWS_DEEPSPEED = {"runners/deepspeed", "runners/__init__.py", "common/dist.py", "common/device.py", "train.py"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


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
