"""From a validated config to live objects: model, datasets, runner."""
from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig, OmegaConf

from lavis_ds.common.registry import registry
from lavis_ds.datasets.loading import ParsedFiles


def build_model(model_cfg: DictConfig, seed: int = 42,
                placement: contextlib.AbstractContextManager | None = None) -> torch.nn.Module:
    """The model of ``model_cfg``; inside ``placement`` (a runner's ``model_placement``) if given."""
    # Every rank initialises from the same seed, so random weights agree before DeepSpeed starts.
    torch.manual_seed(seed)
    cls = registry.get_model_class(model_cfg.arch)
    with placement or contextlib.nullcontext():
        return cls.from_config(OmegaConf.to_container(model_cfg, resolve=True))


def build_datasets(datasets_cfg: DictConfig, parsed_files: ParsedFiles | None = None) -> dict[str, dict]:
    """``{dataset name: {split: Dataset}}``; ``parsed_files``: what ``load_config`` parsed (nothing is parsed twice)."""
    return {name: registry.get_builder_class(section.get("builder", name))(section, parsed_files=parsed_files).build()
            for name, section in datasets_cfg.items()}


def build_runner(cfg: DictConfig, parsed_files: ParsedFiles | None = None):
    """The run's trainer (``runners.Trainer``) holding the engine ``run.runner`` names, on its model and datasets.
    The checkpoint to resume from is chosen, and the engine wrapped, in ``trainer.setup()``, which ``train()`` and
    ``evaluate_only()`` call first."""
    from lavis_ds.runners import Trainer

    engine_class = registry.get_runner_class(cfg.run.runner)
    # The engine that will shard the model says where its LLM is built (e.g. partitioned from the start).
    model = build_model(cfg.model, cfg.run.seed, engine_class.model_placement(cfg))
    datasets = build_datasets(cfg.datasets, parsed_files)
    return Trainer.from_config(cfg, model, datasets)
