"""Libraries imported without the optional packages they load for features lavis_ds never calls
(``lavis_ds.common.imports``): DeepSpeed's autotuner's mlflow, timm's summary helper's wandb."""
import subprocess
import sys
import textwrap

from lavis_ds.common.imports import import_without
from run_utils import REPO


def _write_packages(root):
    """``library`` imports ``optional`` as DeepSpeed and timm import theirs; ``optional`` counts its imports."""
    (root / "optional.py").write_text("import builtins\nbuiltins.optional_imports = getattr(builtins, "
                                      "'optional_imports', 0) + 1\n")
    (root / "library.py").write_text("try:\n    import optional\n    HAS_OPTIONAL = True\n"
                                     "except ImportError:\n    HAS_OPTIONAL = False\n")


def test_the_library_finds_the_package_absent_and_it_imports_afterwards(tmp_path, monkeypatch):
    import builtins

    _write_packages(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("library", "optional"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(builtins, "optional_imports", 0, raising=False)

    library = import_without("library", ("optional",))

    assert library.HAS_OPTIONAL is False
    assert "optional" not in sys.modules and builtins.optional_imports == 0
    import optional  # noqa: F401  (what a tracker hook does when a run names it)
    assert builtins.optional_imports == 1 and sys.modules["optional"] is optional
    assert import_without("library", ("optional",)) is library  # imported once: the same module


def test_a_package_imported_before_stays_visible(tmp_path, monkeypatch):
    _write_packages(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("library", "optional"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import optional

    assert import_without("library", ("optional",)).HAS_OPTIONAL is True
    assert sys.modules["optional"] is optional


def test_checking_a_deepspeed_config_loads_neither_mlflow_nor_wandb():
    """In a fresh process, as ``train.py`` starts: ``import lavis_ds`` (timm) and the config check, where a run
    first imports DeepSpeed. Both packages are installed with the dev extra, and import afterwards."""
    script = textwrap.dedent("""
        import sys
        from lavis_ds.config import load_config
        load_config("projects/demo/tiny_zero2.yaml", check_files=False)
        assert {"timm", "deepspeed"} <= set(sys.modules), "the check no longer imports them: test another door"
        print(sorted(name for name in ("mlflow", "wandb") if name in sys.modules))
        import mlflow, wandb
        print(mlflow.__name__, wandb.__name__)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["[]", "mlflow wandb"]  # DeepSpeed prints a line of its own first
