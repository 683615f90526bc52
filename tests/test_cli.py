"""`lavis-ds <command>`: one command for every job, with the flags of the module that does it; the module paths of
older notes say the command in one line."""
from __future__ import annotations

import runpy
import sys
import tomllib

import pytest

from lavis_ds import cli
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import REPO, run_together, tiny_config, write_yaml


def test_pyproject_installs_the_lavis_ds_command():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"lavis-ds": "lavis_ds.cli:run"}


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_takes_its_modules_flags(command, capsys):
    """`lavis-ds <command> --help` is the help of the module that runs the job: its flags, nothing added."""
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    expected = {"train": "--cfg-path", "export": "--merge-lora", "generate": "--prompt", "chat": "--model",
                "webui": "--model", "show-sample": "--index", "eval": "--include_path"}[command]
    assert text.startswith("usage:") and expected in text


def test_show_sample_through_the_command(tmp_path, capsys):
    storage = ensure_demo_shapes(tmp_path / "demo", DemoShapesSpec(num_train=8, num_val=2, num_test=2))
    cfg = tiny_config(tmp_path / "out", storage)
    path = write_yaml(tmp_path / "run.yaml", cfg)
    assert cli.main(["show-sample", "--cfg-path", str(path), "--index", "1", "--color", "never"]) == 0
    assert "datasets.demo_shapes train[1]" in capsys.readouterr().out


def test_a_bad_config_through_the_command_is_train_pys_one_error(tmp_path, capsys):
    assert cli.main(["train", "--cfg-path", str(tmp_path / "missing.yaml")]) == 2
    assert f"lavis_ds: 1 problem(s) in {tmp_path / 'missing.yaml'}:" in capsys.readouterr().err


def test_no_command_or_an_unknown_one_lists_the_commands(capsys):
    assert cli.main([]) == 2
    assert "show-sample" in capsys.readouterr().err
    assert cli.main(["trian"]) == 2
    assert capsys.readouterr().err == "lavis_ds: unknown command 'trian'; did you mean 'train'?\n"


def test_the_command_and_an_older_module_path_run_as_processes():
    """`python -m lavis_ds.cli` (what the console script runs) and `python -m lavis_ds.generate` of older notes."""
    done = run_together([sys.executable, "-m", "lavis_ds.cli", "--help"],
                        [sys.executable, "-m", "lavis_ds.generate", "--model", "x"])
    assert done[0].returncode == 0 and "lavis-ds <command>" in done[0].stdout, done[0].stderr[-2000:]
    assert done[1].returncode == 2 and done[1].stdout == "", done[1].stderr[-2000:]
    assert done[1].stderr.splitlines()[-1] == ("lavis_ds: `python -m lavis_ds.generate` is `lavis-ds generate` (or "
                                               "`python -m lavis_ds.apps.generate`), with the same flags")


@pytest.mark.parametrize("name", ["generate", "chat", "webui", "export"])
def test_each_older_module_path_names_its_command_instead_of_no_module_named(name, capsys):
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"lavis_ds.{name}", run_name="__main__")
    assert done.value.code == 2
    assert capsys.readouterr().err == (f"lavis_ds: `python -m lavis_ds.{name}` is `lavis-ds {name}` (or "
                                       f"`python -m {cli.COMMANDS[name][0]}`), with the same flags\n")
