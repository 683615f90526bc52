"""From a validated config to live objects: model, datasets, trainer."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from lavis_ds.common.errors import LavisDsError
from lavis_ds.common import registry as reg
from lavis_ds.datasets.loading import ParsedFiles
from lavis_ds.models.export_folder import WEIGHTS_FILE, is_export, load_trained_weights, read_export_config


def build_model(model_cfg: DictConfig, seed: int = 42,
                placement: contextlib.AbstractContextManager | None = None) -> torch.nn.Module:
    """The model of ``model_cfg``; inside ``placement`` (an engine class's ``setup.model_placement``) if given.

    ``model.pretrained`` (with ``load_pretrained``) may name a lavis_ds export (``python export.py``): the model is
    then built as the export's run built it (from the export's seed: the weights it did not train are those) and
    the export's trained weights are loaded - e.g. a preference run starting from an SFT run."""
    section = OmegaConf.to_container(model_cfg, resolve=True)
    export = _pretrained_export(section)
    if export is not None:
        seed = int(read_export_config(export).seed)
        section = {**section, "load_pretrained": False}
    # Every rank initialises from the same seed, so random weights agree before DeepSpeed starts.
    torch.manual_seed(seed)
    cls = reg.models.get(model_cfg.arch)
    with placement or contextlib.nullcontext():
        model = cls.from_config(section)
    if export is not None:
        _load_export_weights(model, export)
    return model


def _pretrained_export(section: dict) -> Path | None:
    """The export folder ``model.pretrained`` names (None: none, or published weights the model class reads)."""
    path = section.get("pretrained") if section.get("load_pretrained") else None
    return Path(os.path.expanduser(path)) if isinstance(path, str) and is_export(os.path.expanduser(path)) else None


def _load_export_weights(model: torch.nn.Module, export: Path) -> None:
    from safetensors.torch import load_file

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise LavisDsError(f"model.pretrained: {export} is a lavis_ds export, which loads into a whole model, not one "
                           f"ZeRO-3 partitions while it is built; start from it with ZeRO-0/1/2 or runner_fsdp")
    load_trained_weights(model, load_file(str(export / WEIGHTS_FILE)), f"model.pretrained: {export / WEIGHTS_FILE}")


def prepare_datasets(datasets_cfg: DictConfig) -> None:
    """Generate the data builders make on first use (the demo's images, annotations and tokenizer), before
    anything reads it: the model's tokenizer may be among it. Idempotent, and safe on every rank at once."""
    for name, section in datasets_cfg.items():
        reg.builders.get(section.get("builder", name))(section).prepare()


def build_datasets(datasets_cfg: DictConfig, parsed_files: ParsedFiles | None = None) -> dict[str, dict]:
    """``{dataset name: {split: Dataset}}``; ``parsed_files``: what ``load_config`` parsed (nothing is parsed twice)."""
    return {name: reg.builders.get(section.get("builder", name))(section, parsed_files=parsed_files).build()
            for name, section in datasets_cfg.items()}


def build_trainer(cfg: DictConfig, parsed_files: ParsedFiles | None = None):
    """The run's trainer (``runners.Trainer``) holding the engine ``run.runner`` names, on its model and datasets.
    The checkpoint to resume from is chosen, and the engine wrapped, in ``trainer.setup()``, which ``train()`` and
    ``evaluate_only()`` call first."""
    from lavis_ds.runners import Trainer

    engine_class = reg.engines.get(cfg.run.runner)
    prepare_datasets(cfg.datasets)
    # The engine that will shard the model says where its LLM is built (e.g. partitioned from the start).
    model = build_model(cfg.model, cfg.run.seed, engine_class.setup.model_placement(cfg))
    datasets = build_datasets(cfg.datasets, parsed_files)
    return Trainer.from_config(cfg, model, datasets)
