"""A model that lives outside lavis_ds, registered by the user and named under `imports:`."""
from __future__ import annotations

import textwrap

import pytest

from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import run_train, train_steps, write_yaml

USER_MODEL = '''
"""A user's model: predicts twice the mean colour of the image. Not part of lavis_ds."""
from pathlib import Path

import torch
from torch import nn

from lavis_ds.common.registry import registry
from lavis_ds.models.base import BaseModel
from lavis_ds.models.settings.base import ModelSettings


class ColourRegressorSettings(ModelSettings):
    """The model's own rule across its keys, checked when the config loads."""

    def problems(self):
        args = self.arguments()
        if args["scale"] <= 0 and args["hidden"] < 4:
            return [f"model.scale: {args['scale']} needs model.hidden >= 4 (got {args['hidden']}) to learn a sign"]
        return []


@registry.register_model("user_colour_regressor")
class ColourRegressor(BaseModel):
    # An absolute path: presets may live beside the user's module.
    PRETRAINED_MODEL_CONFIG_DICT = {"default": str(Path(__file__).with_name("colour_regressor.yaml"))}
    SETTINGS = ColourRegressorSettings

    def __init__(self, *, hidden: int = 8, scale: float = 2.0):
        super().__init__()
        self.scale = scale
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 3))

    def forward(self, samples):
        colour = samples["image"].float().mean(dim=(2, 3))
        err = (self.net(colour).float() - self.scale * colour) ** 2
        return {"loss": err.mean(), "loss_sum": err.sum().detach(), "num_tokens": err.numel()}
'''


def test_user_module_registers_a_model_that_trains_through_train_py(tmp_path):
    pkg = tmp_path / "my_ext"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "colour_regressor.py").write_text(textwrap.dedent(USER_MODEL))
    (pkg / "colour_regressor.yaml").write_text("model:\n  arch: user_colour_regressor\n  hidden: 16\n")
    storage = tmp_path / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=64, num_val=8, num_test=8))

    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "user.yaml", {
        "imports": ["my_ext.colour_regressor"],
        "model": {"arch": "user_colour_regressor", "scale": 1.5},
        "datasets": {"demo_shapes": {"build_info": {"storage": str(storage), "num_train": 64,
                                                   "num_val": 8, "num_test": 8}}},
        "run": {"output_dir": str(out), "init_lr": 0.05, "max_epoch": 4, "log_freq": 1, "valid_splits": ["val"],
                "batch_size_train": 8, "zero_stage": 1},
    })
    run_train(cfg, nproc=2, cwd=tmp_path)  # the user's package is found from the working directory

    losses = [m["loss"] for m in train_steps(out)]
    assert len(losses) == 4 * 64 // 16
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
    assert "hidden: 16" in (out / "config.yaml").read_text()  # the user's preset was merged


def test_unimportable_module_is_a_config_error(tmp_path):
    cfg = write_yaml(tmp_path / "bad.yaml", {"imports": ["no_such_pkg.model"], "model": {"arch": "x"},
                                              "datasets": {}, "run": {"output_dir": str(tmp_path)}})
    proc = run_train(cfg, nproc=0, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "imports[0]: cannot import 'no_such_pkg.model': ModuleNotFoundError" in proc.stderr


def _user_package(tmp_path):
    pkg = tmp_path / "my_ext"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "colour_regressor.py").write_text(textwrap.dedent(USER_MODEL))
    (pkg / "colour_regressor.yaml").write_text("model:\n  arch: user_colour_regressor\n  hidden: 16\n")
    return pkg


def test_what_a_user_model_lacks_for_the_run_is_named_at_load_time(tmp_path, monkeypatch):
    """The model above trains; it cannot answer (no generate) nor be sharded block by block (no repeated_blocks):
    a run that needs either is refused before anything is built, naming the method and the setting."""
    from lavis_ds.config import ConfigError, load_config

    _user_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    storage = tmp_path / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=16, num_val=8, num_test=8))
    cfg = write_yaml(tmp_path / "user.yaml", {
        "imports": ["my_ext.colour_regressor"], "model": {"arch": "user_colour_regressor"},
        "datasets": {"demo_shapes": {"build_info": {"storage": str(storage), "num_train": 16, "num_val": 8,
                                                   "num_test": 8}}},
        "run": {"output_dir": str(tmp_path / "out"), "test_splits": ["test"], "runner": "runner_fsdp",
                "batch_size_train": 4}})
    try:
        load_config(cfg)
    except ConfigError as e:
        problems = e.problems
    else:
        raise AssertionError("the config check let a model without generate() and repeated_blocks() through")
    assert ("model.arch: user_colour_regressor (ColourRegressor) has no generate(samples, synced_gpus=False, "
            "**generate_kwargs) -> list[str], which run.test_splits needs" in "\n".join(problems))
    assert any("has no repeated_blocks() -> list[nn.Module], which run.runner: runner_fsdp needs" in p
               for p in problems)
    assert len(problems) == 2
    load_config(cfg, ["run.test_splits=[]", "run.runner=runner_deepspeed"])  # what it has is enough for this run

    # Its own rule across keys (its SETTINGS class) is checked with the rest.
    with pytest.raises(ConfigError, match=r"model\.scale: -1(\.0)? needs model\.hidden >= 4 \(got 2\)"):
        load_config(cfg, ["run.test_splits=[]", "run.runner=runner_deepspeed", "model.scale=-1", "model.hidden=2"])
