"""A trained tiny demo model, exported: what the inference tests (batch, terminal, browser) talk to.

Trained once per test session (conftest.py's ``demo_export`` fixture) through the path a
user takes: ``train.py`` on 2 processes on generated demo_shapes data (forked from the suite's
server, tests/forked.py: the same weights as under torchrun, bit for bit; torchrun itself is
tested in test_train.py, test_preemption.py, test_multinode.py), then ``export.py``'s
``export_checkpoint``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import run_train, tiny_config, write_yaml

# Enough steps (6 epochs x 16 optimizer steps) for answers of several words that depend on the image and the question
# (the demo's "a red circle" format).
SPEC = DemoShapesSpec(num_train=256, num_val=16, num_test=16)
CAPTION_PROMPT = "Describe the image in a few words."


@dataclass(frozen=True)
class DemoExport:
    folder: Path  # the export (model.safetensors, config.yaml, tokenizer/)
    storage: Path  # the demo data: images/, annotations/{train,val,test}.json

    num_test: int = SPEC.num_test

    def image(self, split: str = "test", index: int = 0) -> Path:
        return self.storage / "images" / f"{split}_{index:05d}.png"

    @property
    def test_annotations(self) -> Path:
        return self.storage / "annotations" / "test.json"


def train_and_export(root: Path) -> DemoExport:
    from lavis_ds.apps.export import export_checkpoint

    storage = ensure_demo_shapes(root / "demo_shapes", SPEC)
    cfg = tiny_config(root / "run", storage, stage=2, micro=8, max_epoch=6, warmup_steps=4)
    run_train(write_yaml(root / "demo.yaml", cfg), nproc=2)
    return DemoExport(export_checkpoint(root / "run", root / "export"), storage)
