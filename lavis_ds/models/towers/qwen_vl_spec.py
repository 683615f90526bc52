"""What a Qwen-VL vision tower is built from, read before (or without) building one: the config side of
``towers.qwen_vl``.

Each Qwen-VL tower class carries one :class:`QwenVLSpec` (``SPEC``): its transformers vision config class and the
``model_type`` of the published folders it reads, its presets, how a config becomes the block sizes (:class:`Layout`)
and which MLP and norm the blocks hold, its patch embedding's bias, image normalisation and video sampling. The spec
checks a section's ``vision_config`` keys and reads a folder's ``config.json``; the tower builds the modules.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.common.suggest import did_you_mean
from lavis_ds.models.parts import PartError
from lavis_ds.processors.image import CLIP_MEAN, CLIP_STD


@dataclass(frozen=True)
class Layout:
    """The sizes a tower is built from, read from its transformers vision config."""

    width: int
    depth: int
    heads: int
    mlp_hidden: int
    act: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    theta: float


@dataclass(frozen=True)
class QwenVLSpec:
    """One Qwen-VL tower kind (module docstring)."""

    config_class: type  # the transformers vision config (Qwen2VLVisionConfig, ...)
    model_type: str  # config.json model_type of the published folders the tower reads
    presets: Mapping[str, dict[str, Any]]  # name -> config arguments (+ "hub_id": a published folder)
    layout_of: Callable[[Any], Layout]  # a config of config_class -> the block sizes
    mlp: Callable[[Layout], nn.Module]  # the blocks' MLP
    norm: type[nn.Module]  # the blocks' norm
    patch_bias: bool = False  # whether the Conv3d patch embedding has a bias (Qwen3-VL's has)
    image_mean: tuple[float, float, float] = CLIP_MEAN  # what the published image processor normalises by
    image_std: tuple[float, float, float] = CLIP_STD
    # How the family's published video processor samples and sizes a video (``QwenVLProcessing``'s ``video_*``
    # settings); none: the dataset's max_frames frames, each bounded as an image (Qwen2-VL's video processor).
    video_sampling: Mapping[str, Any] = field(default_factory=dict)

    def config_keys(self) -> list[str]:
        """The vision config's own keys (``depth``, ``num_heads``, ...), not those every transformers config has."""
        return sorted(self.config_class.__annotations__)

    def config(self, preset: str, overrides: dict[str, Any], tower: str) -> Any:
        """The transformers vision config of a preset and the section's ``vision_config`` keys, each key checked (a
        transformers config keeps an unknown key as an attribute without a word); ``tower`` names it in messages."""
        from huggingface_hub.errors import StrictDataclassError

        if preset not in self.presets:
            raise PartError(f"vision_tower.preset: {preset!r} is not a {tower} preset; presets: "
                            f"{', '.join(self.presets)}")
        arguments = {k: v for k, v in self.presets[preset].items() if k != "hub_id"}
        valid = self.config_keys()
        unknown = [key for key in overrides if key not in valid]
        if unknown:
            hints = "; ".join(f"{key}: {did_you_mean(key, valid, '')}".rstrip("; ") for key in unknown)
            raise PartError(f"vision_tower.vision_config: unknown key(s) {hints}; valid keys of "
                            f"{self.config_class.__name__}: {', '.join(valid)}")
        try:
            return self.config_class(**{**arguments, **overrides})
        except (StrictDataclassError, TypeError, ValueError) as e:  # a mistyped value
            raise PartError(f"vision_tower.vision_config: {e}".replace("\n", " ")) from None

    def video_settings(self, fps: float | None, min_pixels: int | None, max_pixels: int | None) -> dict[str, Any]:
        """The processing's ``video_*`` settings: those given, else the family's (``video_sampling``)."""
        given = {"video_fps": fps, "video_min_pixels": min_pixels, "video_max_pixels": max_pixels}
        return {**self.video_sampling, **{key: value for key, value in given.items() if value is not None}}

    def hub_example(self) -> str:
        """A published folder of this kind, for messages."""
        return next(p["hub_id"] for p in self.presets.values() if "hub_id" in p)

    def folder_section(self, folder: str, section: Mapping[str, Any], path: str, tower: str) -> dict[str, Any]:
        """``section`` with the architecture of a published folder: its config.json's ``vision_config`` (model_type
        ``model_type``); ``tower`` names the tower in messages."""
        config_file = Path(folder).expanduser() / "config.json"
        if not config_file.is_file():
            raise PartError(f"{path}.pretrained: {folder} has no config.json; expected a transformers "
                            f"{self.model_type} folder such as {self.hub_example()}")
        config = json.loads(config_file.read_text())
        model_type = config.get("model_type")
        if model_type != self.model_type:
            other = next((name for name in reg.vision_towers
                          if getattr(getattr(reg.vision_towers.get(name), "SPEC", None), "model_type", None)
                          == model_type), None)
            hint = f"; for this folder use vision tower {other!r}" if other else ""
            raise PartError(f"{path}.pretrained: {config_file} has model_type {model_type!r}, but the "
                            f"{tower} tower reads model_type {self.model_type!r} (a folder such as "
                            f"{self.hub_example()}){hint}")
        vision = config.get("vision_config") or {}
        own = {k: v for k, v in vision.items() if k in self.config_keys()}
        return {**section, "vision_config": own, "preset": section.get("preset", next(iter(self.presets)))}
