"""What vision towers and connectors share: one config section each, built by name from their registry.

A composed architecture (``llava``, ``instructblip``) holds a tower and a connector as fields, each
configured by one section named after its registry entry::

    vision_tower: {name: clip, preset: vit_l_14_336, pretrained: /models/clip-vit-large-patch14-336,
                   vision_feature_layer: -2, vision_feature_select_strategy: default, freeze: true}
    connector: {name: mlp2x_gelu}

The section's keys other than ``name`` are the part class's ``from_config`` keys: its constructor's
keyword arguments plus ``pretrained`` (a local file or folder of published weights) for parts that read one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from torch import nn

from lavis_ds.common.errors import InputError
from lavis_ds.common.registry import Registry
from lavis_ds.common.schema import did_you_mean, fields_of


class PartError(InputError, ValueError):
    """A tower or connector that cannot be built as configured: an unknown name or key, a folder of another
    model type, an image size the tower cannot take, a missing tokenizer folder."""


def build_part(kind: Registry, section: Mapping[str, Any], path: str, **given: Any) -> nn.Module:
    """The part ``section['name']`` names in ``kind``, built by its class's ``from_config``.

    Args:
        kind: ``registry.vision_towers`` or ``registry.connectors``.
        section: The part's config section (``name`` plus the class's keys).
        path: Where the section sits in the run config (``model.connector``), for messages.
        given: Arguments the architecture supplies rather than the user (a connector's ``vision_width``).
    """
    section = dict(section)
    if "name" not in section:
        raise PartError(f"{path}.name: missing; known {kind.kind}s: {', '.join(kind)}")
    name = section.pop("name")
    try:
        cls = kind.get(name)
    except KeyError as e:
        raise PartError(f"{path}.name: {e.args[0]}") from None
    return cls.from_config(section, path=path, **given)


def check_keys(cls: type, section: Mapping[str, Any], path: str, extra: tuple[str, ...] = ()) -> None:
    """Raise ``PartError`` naming every key of ``section`` that ``cls``'s constructor (or ``extra``) lacks."""
    valid = [*fields_of(cls), *extra]
    unknown = [key for key in section if key not in valid]
    if unknown:
        hints = [f"{path}.{key}: unknown key" + (f"; {close}" if (close := did_you_mean(key, valid, "")) else "")
                 for key in unknown]
        raise PartError("; ".join(hints) + f". Valid keys of {cls.__name__}: {', '.join(sorted(valid))}")


class Part(nn.Module):
    """A tower or connector: freezes its own submodules and keeps the frozen ones in eval mode.

    Frozen submodules stay in eval whatever ``train()`` the host model calls (as LAVIS's ``disabled_train``):
    dropout and drop-path in a frozen part would only add noise to the features the trainable parts learn from.
    """

    def __init__(self) -> None:
        super().__init__()
        self._eval_only: frozenset[str] = frozenset()  # names of the frozen submodules, kept in eval

    def freeze_submodule(self, name: str = "") -> None:
        """Freeze submodule ``name`` (dotted; ``""`` is the whole part) and keep it in eval mode from now on."""
        module = self.get_submodule(name)
        module.requires_grad_(False)
        nn.Module.train(module, False)
        self._eval_only = self._eval_only | {name}

    def train(self, mode: bool = True) -> "Part":
        super().train(mode)
        for name in sorted(self._eval_only):
            nn.Module.train(self.get_submodule(name), False)  # not .eval(): for name "" that would recurse here
        return self


def read_safetensors(folder: Path, keep: Callable[[str], bool], path: str) -> dict[str, torch.Tensor]:
    """The tensors of a transformers folder (one file or an index with shards) whose key ``keep`` accepts, read
    one at a time: a published VLM's LLM shards, most of the folder, are never loaded for its tower or projector."""
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    from transformers.utils.hub import get_checkpoint_shard_files

    if (folder / SAFE_WEIGHTS_NAME).is_file():
        files = [folder / SAFE_WEIGHTS_NAME]
    elif (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        files, _ = get_checkpoint_shard_files(str(folder), str(folder / SAFE_WEIGHTS_INDEX_NAME), local_files_only=True)
    else:
        raise PartError(f"{path}: {folder} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}")
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            state.update((key, f.get_tensor(key)) for key in f.keys() if keep(key))
    return state


def load_exactly(module: nn.Module, state: Mapping[str, torch.Tensor], path: str, what: str) -> None:
    """Copy ``state`` into ``module`` when it names every parameter and buffer, shape for shape; else one
    :class:`PartError` under the config key ``path`` (``what``: the file's part against ours, for the message)."""
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unexpected:
        raise PartError(f"{path}: {what}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    shapes = [f"{k}: {tuple(v.shape)} vs ours {tuple(own[k].shape)}" for k, v in state.items()
              if v.shape != own[k].shape]
    if shapes:
        raise PartError(f"{path}: {what}: the weights differ in shape: {shapes[:3]}")
    module.load_state_dict(state, strict=True)

