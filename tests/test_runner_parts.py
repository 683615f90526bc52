"""The trainer and its engines are built from parts: every attribute their classes keep is declared in a
constructor, the loop's class stays small (its engine, data and hooks are objects it holds, not classes it inherits),
and so do the engines (their config section, checkpoint reading and process set-up are parts they hold as class
attributes)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lavis_ds  # noqa: F401  (fills the registries)
from class_shape import ClassSource
from conftest import user_module_imported
from lavis_ds.common import registry as reg
from lavis_ds.runners.engine import Engine, EngineCheckpoints, EngineConfig, EngineSetup
from lavis_ds.runners.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((REPO / "lavis_ds" / "runners").rglob("*.py")), REPO / "tests" / "plain_engine.py",
           REPO / "tests" / "ddp_engine.py", REPO / "tests" / "control_engine.py"]


def _classes() -> dict[str, tuple[list[str], set[str], dict[str, set[str]]]]:
    """Every class of the loop's and the engines' sources: (its bases' names, what its __init__ and class body declare,
    what each other method assigns on self)."""
    classes = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                source = ClassSource(node)
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases]
                classes[node.name] = (bases, source.declared, source.set_by)
    return classes


def test_no_trainer_or_engine_attribute_appears_after_the_constructor():
    classes = _classes()

    def declared(name: str) -> set[str]:
        bases, own, _ = classes.get(name, ([], set(), {}))
        return own.union(*(declared(base) for base in bases))

    late = {f"{name}.{method}: self.{attr}" for name, (_, _, methods) in classes.items()
            for method, attrs in methods.items() for attr in attrs - declared(name)}
    assert "Trainer" in classes and "DeepSpeedEngine" in classes and "FSDPEngine" in classes  # the scan sees them
    assert late == set()


def test_the_loop_holds_its_parts_in_a_class_of_about_25_members():
    attributes = _classes()["Trainer"][1]
    members = {name for name in dir(Trainer) if not name.startswith("__")} | attributes
    assert {"engine", "data", "hooks", "plan"} <= members and len(members) <= 26, sorted(members)
    assert Trainer.__mro__ == (Trainer, object)  # composed, not inherited


def _members(cls: type, classes: dict) -> set[str]:
    """Methods, class attributes and constructor attributes of ``cls``, its bases' included."""
    def declared(name: str) -> set[str]:
        bases, own, _ = classes.get(name, ([], set(), {}))
        return own.union(*(declared(base) for base in bases))

    return {name for name in dir(cls) if not name.startswith("__")} | declared(cls.__name__)


@pytest.fixture
def ddp_engine_imported():
    """The user's engine, registered for this test only."""
    with user_module_imported("ddp_engine", reg.engines):
        yield


def test_every_engine_holds_its_config_checkpoints_and_setup_parts_and_stays_near_25_members(ddp_engine_imported):
    classes = _classes()
    interface = _members(Engine, classes)
    assert {"config", "checkpoints", "setup", "wrap", "forward_backward", "run", "plan"} <= interface
    assert len(interface) <= 22, sorted(interface)
    engines = reg.engines.distinct()
    assert {"runner_deepspeed", "runner_fsdp", "runner_ddp_test"} <= set(engines)
    for name, engine in engines.items():
        assert issubclass(engine.config, EngineConfig) and issubclass(engine.checkpoints, EngineCheckpoints), name
        assert issubclass(engine.setup, EngineSetup), name
        added = _members(engine, classes) - interface  # what the engine keeps beyond the interface: its state
        assert len(added) <= 5 and len(interface | added) <= 26, (name, sorted(added))
    assert engines["runner_fsdp"].config.KEY == "fsdp" and engines["runner_ddp_test"].checkpoints.FILES == ("ddp.pt",)


def test_an_engine_whose_forward_backward_takes_a_loop_callback_is_named_at_its_import(tmp_path, monkeypatch):
    """A user's engine whose forward_backward takes a callback of the loop beside its micro-batches fails where the
    config check reports it (the import of its module under `imports:`), naming the method and what it must be,
    not at the first step."""
    from lavis_ds.config import ConfigError, import_user_modules

    (tmp_path / "old_engine.py").write_text(
        "from lavis_ds.runners.engine import Engine\n\n"
        "class OldEngine(Engine):\n"
        "    def forward_backward(self, micro_batches, loss_weight, then=None):\n"
        "        return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as raised:
        import_user_modules(["old_engine"], source="run.yaml")  # a module that fails to import is not kept
    message = str(raised.value)
    assert "imports[0]: cannot import 'old_engine'" in message
    assert ("old_engine.OldEngine.forward_backward(self, micro_batches, loss_weight, then=None) must be "
            "forward_backward(self, micro_batches, loss_weight)") in message
    assert "Forwarded(losses, last_backward)" in message
