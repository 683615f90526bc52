"""What every registered model shares: named presets, ``from_config``, frozen parts that stay in eval.

A model's config keys are its constructor's keyword arguments (the config
validator reads them from the signature), so a constructor must take only
keyword-only arguments, each with a default and a plain annotation (int,
float, bool, str, ``X | None``, ``list[X]``, ``dict[str, Any]``,
``Literal[...]``, ``Any``).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.common.suggest import did_you_mean
from lavis_ds.models.settings.base import ModelSettings

logger = logging.getLogger(__name__)

# Presets are package data: they ship inside lavis_ds, never beside a user's project.
CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"

# Keys every `model:` section may hold besides the constructor's arguments.
COMMON_KEYS = ("arch", "model_type", "load_pretrained", "pretrained")


@dataclass(frozen=True)
class Need:
    """One thing the runners or apps call on a model: its name, how it is called, what it is for."""

    name: str
    call: str


# The model contract: what a registered model must provide, by what a run or command uses. The config check
# names what a model lacks for the chosen runner and splits (`missing`); docs/extending.md explains each.
CONTRACT: dict[str, tuple[Need, ...]] = {
    # every training or validation split: the loss, and what averages it exactly over micro-batches and ranks
    "train": (Need("forward", "forward(samples) -> {'loss', 'loss_sum', 'num_tokens'}"),),
    # a preference objective (run.task: dpo, simpo, orpo): one vision pass per pair, both answers' log-probs
    "pairs": (Need("image_features", "image_features(samples) -> [image tokens, hidden] (flat)"),
              Need("answer_logps", "answer_logps(samples, image_features) -> (logp_sum [B], num_tokens [B])"),
              Need("prepare_batch", "prepare_batch({'instruction', 'output', 'num_images'}) -> {'labels', ...}"),
              Need("forward", "forward(samples) -> samples['objective'](self, samples).as_dict() where a batch "
                              "names its objective")),
    # test splits, generation metrics on validation splits, batch inference, chat
    "generate": (Need("generate", "generate(samples, synced_gpus=False, **generate_kwargs) -> list[str]"),),
    # runner_fsdp: the units it shards one by one (e.g. the ViT's and the LLM's transformer blocks)
    "shard": (Need("repeated_blocks", "repeated_blocks() -> list[nn.Module]"),),
    # run.packing: prepare_batch(samples, pack_to=N) lays the samples end to end in rows (its settings' PACKS)
    "pack": (Need("SETTINGS.PACKS", "SETTINGS.PACKS = True and prepare_batch(samples, pack_to=None) that packs"),),
    # run.batch_unit: tokens: the exact tokens of text-only samples, to fit the length estimate the plan uses
    "count": (Need("prepare_batch", "prepare_batch({'instruction', 'output', 'num_images'}) -> "
                                    "{'attention_mask', ...}"),),
    # export --merge-lora: the LLM as a plain Hugging Face model, its tokenizer, and what goes beside it
    "merge": (Need("merge_lora", "merge_lora() -> transformers.PreTrainedModel"),
              Need("llm", "llm (a models.chat_llm.ChatLLM: llm.tokenizer, the transformers tokenizer it saves)"),
              Need("LLM_PREFIX", "LLM_PREFIX = the state_dict prefix of the LLM merge_lora returns"),
              Need("CONNECTOR_PREFIXES", "CONNECTOR_PREFIXES = prefixes of parameters written even when frozen"),
              Need("SETTINGS.merged_llm_settings",
                   "SETTINGS.merged_llm_settings(folder) -> the model: keys that load the merged LLM")),
    # chat, the web page, batch inference and the Hugging Face processor export: the prompt and the LLM's limits
    "chat": (Need("llm", "llm (a models.chat_llm.ChatLLM: llm.prompt, a models.prompt.ChatPrompt with "
                         "generation_prompt, image_token_id, ...; llm.tokenizer; llm.config, the LLM's transformers "
                         "config with max_position_embeddings, ...; llm.stop_token_ids() -> list[int]; llm.pad_id)"),
             Need("SETTINGS.image_size", "SETTINGS(arch, section).image_size() -> the image side its tower takes")),
    # show_sample: the prompt a model: section builds, without weights
    "show_sample": (Need("SETTINGS.prompt", "SETTINGS(arch, section).prompt() -> models.prompt.ChatPrompt"),),
}


def missing(cls: type, uses: Iterable[str]) -> list[Need]:
    """The contract's needs of ``uses`` (keys of CONTRACT) that model class ``cls`` does not provide (a dotted name:
    an attribute of an attribute, such as the settings class's ``SETTINGS.prompt``)."""
    lacking = []
    # An attribute the constructor sets is declared by a class annotation (``llm: ChatLLM``).
    declared = {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}
    for use in uses:
        for need in CONTRACT[use]:
            own = functools.reduce(lambda owner, name: getattr(owner, name, None), need.name.split("."), cls)
            own = own or (need.name in declared)
            if not own or (need.name == "forward" and own is nn.Module.forward):
                lacking.append(need)
    return lacking


class BaseModel(nn.Module):
    """Base class of registered models.

    Subclasses fill ``PRETRAINED_MODEL_CONFIG_DICT`` (model_type -> YAML path
    relative to ``lavis_ds/configs/``) and take plain keyword arguments.
    """

    PRETRAINED_MODEL_CONFIG_DICT: dict[str, str] = {}
    # (old prefix, new prefix) of parameter names the architecture's checkpoints and exports may hold from when its
    # parameters were named otherwise: read under the new names (``export_folder.load_trained_weights``)
    RENAMED_KEYS: tuple[tuple[str, str], ...] = ()
    # The class that reads a `model:` section of this model without building it (``lavis_ds.models.settings``):
    # ``model_settings(cls, section)`` makes one from the class, whose constructor's keywords are the section's schema.
    SETTINGS: type[ModelSettings] = ModelSettings

    # Submodules a subclass froze and keeps in eval whatever ``train()`` is called with (LAVIS's ``disabled_train``:
    # dropout in a frozen part would only add noise); a subclass's constructor sets its instance's own set.
    _eval_only: frozenset[str] = frozenset()

    @classmethod
    def default_config_path(cls, model_type: str) -> Path:
        """Path of the preset YAML for ``model_type``; unknown types raise ``KeyError`` naming the valid ones."""
        presets = cls.PRETRAINED_MODEL_CONFIG_DICT
        if model_type in cls.SETTINGS.REPLACED_MODEL_TYPES:
            instead, why = cls.SETTINGS.REPLACED_MODEL_TYPES[model_type]
            others = ", ".join(p for p in presets if p != instead)
            raise KeyError(f"model_type {model_type!r} is not supported: {why}. Use the {cls.__name__} preset "
                           f"{instead!r} (or {others}) with model.llm_model naming the matching Hugging Face folder.")
        if model_type not in presets:
            hint = did_you_mean(model_type, presets, sentence=True)
            hint = f" {hint}" if hint else ""
            raise KeyError(
                f"Unknown model_type {model_type!r} for {cls.__name__}.{hint} "
                f"Valid model_types: {', '.join(presets) or '(none)'}."
            )
        return CONFIG_ROOT / presets[model_type]

    @classmethod
    def default_config(cls, model_type: str) -> dict[str, Any]:
        """The ``model:`` section of a preset YAML as a plain dict."""
        section = OmegaConf.load(cls.default_config_path(model_type)).model
        return OmegaConf.to_container(section, resolve=True)  # type: ignore[return-value]

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DictConfig) -> "BaseModel":
        """Build from an already merged and validated ``model:`` section."""
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        kwargs = dict(cfg)
        common = {key: kwargs.pop(key, None) for key in COMMON_KEYS}
        model = cls(**kwargs)
        if common["load_pretrained"] and common["pretrained"]:
            model.load_from_pretrained(common["pretrained"])
        elif common["load_pretrained"]:
            # The full-size presets say load_pretrained: true with pretrained: null, for dry runs.
            logger.warning("%s: load_pretrained is true but pretrained is null: the weights it would load "
                           "stay randomly initialised (fine for a dry run only).", cls.__name__)
        elif common["pretrained"]:
            logger.info("%s: pretrained=%r is not loaded because load_pretrained is false.",
                        cls.__name__, common["pretrained"])
        return model

    def load_from_pretrained(self, path: str) -> None:
        """Load the published checkpoint ``path`` (config: ``load_pretrained`` + ``pretrained``).

        LAVIS's name for it. Models that can read published weights override this.
        """
        raise NotImplementedError(f"{type(self).__name__} has no loader for published weights, so it cannot load "
                                  f"{path!r}; set load_pretrained: false")

    def prepare_batch(self, samples: dict[str, Any]) -> dict[str, Any]:
        """``samples`` with what the loss needs computed on the host (e.g. the tokenized prompt), before the step
        moves them to the device. Called by the runner on every training micro-batch. Default: as given."""
        return samples

    def supervised_tokens(self, samples: dict[str, Any]) -> int | None:
        """How many tokens of the prepared micro-batch the loss is summed over (``run.loss_reduction: tokens``
        divides the step's summed loss by these over every micro-batch and rank). None: this model cannot say,
        and its steps average the micro-batches' mean losses instead. Default: None."""
        return None

    def save_run_files(self, output_dir: str | Path) -> None:
        """Write what a run's outputs need besides checkpoints to be used later (e.g. a tokenizer).

        Called once per run on the main process, before training. Default: nothing.
        """

    def flop_model(self) -> Any:
        """What a training sample costs in FLOPs (a ``lavis_ds.models.flops.FlopModel``), for the logged MFU, or
        None (default): the model does not say."""
        return None

    def train(self, mode: bool = True) -> "BaseModel":
        """Switch mode like ``nn.Module.train``, except that frozen submodules stay in eval."""
        super().train(mode)
        for name in sorted(self._eval_only):
            self.get_submodule(name).eval()
        return self
