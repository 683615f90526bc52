"""A vision-LLM composed of registered parts: a vision tower, a connector, and the chat LLM of ``VisionLLM``.

The model holds its parts as fields, each built from one config section named after its registry kind::

    vision_tower: {name: clip, preset: vit_l_14_336, vision_feature_layer: -2}
    connector: {name: mlp2x_gelu}

(see ``lavis_ds.models.parts``). The image path is ``connector(vision_tower(images), connector inputs)``;
an instruction-aware connector (InstructBLIP's Q-Former) gets its inputs from ``connector.prepare``, which
``prepare_batch`` runs on the host (``HostBatch.connector_fields``). Registered architectures (``llava``, ``instructblip``)
are subclasses that only name their default parts, presets and published-checkpoint formats; any tower
with any connector trains by YAML (``arch: llava`` with ``vision_tower: {name: siglip}`` and
``connector: {name: qformer}``).

Its datasets get the tower's own image processing (``IMAGE_PROCESSORS``: ``tower_image_train`` / ``tower_image_eval``,
their keys filled from ``image_processing_of(section)`` when the config is loaded; ``lavis_ds.image_config``).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from lavis_ds.common.registry import Registry, connectors, vision_towers
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.models.parts import PART_KINDS, PartError, check_layouts, given_part_sections
from lavis_ds.models.published import load_published, settings_from_published
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.processors.image import ImageProcessing

# Keys a part section takes besides its class's constructor arguments (``parts.build_part``).
PART_EXTRA_KEYS = ("name", "pretrained", "freeze")


class ComposedVisionLLM(VisionLLM):
    """``vision_tower`` -> ``connector`` -> image tokens spliced into ``llm_model``; subclasses name defaults."""

    # The part sections an architecture uses when the config leaves one out (subclasses override).
    DEFAULT_PARTS: dict[str, dict[str, Any]] = {"vision_tower": {"name": "clip"}, "connector": {"name": "mlp2x_gelu"}}
    # A dataset that names no image processor gets the tower's own processing (filled in by the config loader).
    IMAGE_PROCESSORS = {"train": "tower_image_train", "eval": "tower_image_eval"}
    CONNECTOR_PREFIXES = ("connector.",)
    # Whether the architecture takes parts with flat features of images of their own sizes (``FLAT_FEATURES``: the
    # Qwen-VL towers and patch_merger) instead of fixed-size towers and connectors.
    FLAT_FEATURES = False

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DictConfig) -> "ComposedVisionLLM":
        """Build from a ``model:`` section; a published folder in ``pretrained`` (with ``load_pretrained``) first
        gives the settings that come with its weights (``models.published.settings_from_published``)."""
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        return super().from_config(cls.published_settings(cls._with_parts(cfg)))

    def load_from_pretrained(self, path: str) -> None:
        """A ``LlavaForConditionalGeneration`` or ``InstructBlipForConditionalGeneration`` folder (every part),
        LAVIS's InstructBLIP ``.pth`` or LLaVA's stage-1 ``mm_projector.bin`` (the parts it holds); each part
        checked against the configured one (``lavis_ds.models.published``)."""
        load_published(self, path)

    # ----------------------------------------------------------------- config side (nothing built, no weights)
    @classmethod
    def settings_of(cls, section: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's arguments, with what a published folder in ``pretrained`` fixes (its image token)."""
        try:
            section = cls.published_settings(cls._with_parts(section))
        except PartError:
            pass  # config_problems reports the folder
        return super().settings_of(section)

    @classmethod
    def published_settings(cls, section: dict[str, Any]) -> dict[str, Any]:
        """``section`` with the settings a published folder in ``pretrained`` fixes (``settings_from_published``)."""
        return settings_from_published(section)

    @classmethod
    def part_sections(cls, section: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tower's and the connector's sections a ``model:`` section describes (an architecture with keys of its
        own for them translates those)."""
        return given_part_sections(cls, section)

    @classmethod
    def _with_parts(cls, section: Mapping[str, Any]) -> dict[str, Any]:
        """``section`` with both part sections present (the architecture's defaults where left out)."""
        return {**section, **dict(zip(PART_KINDS, cls.part_sections(section)))}

    @classmethod
    def preset_under(cls, defaults: DictConfig, section: DictConfig) -> DictConfig:
        """A user's part section that names another part replaces the preset's section instead of merging into
        it: the preset's keys belong to the preset's part (``vision_tower: {name: siglip}`` over a CLIP preset)."""
        defaults = defaults.copy()
        for key in PART_KINDS:
            given, preset = section.get(key), defaults.get(key)
            if isinstance(given, (DictConfig, dict)) and isinstance(preset, DictConfig) \
                    and "name" in given and given.get("name") != preset.get("name"):
                defaults[key] = OmegaConf.create({})
        return defaults

    @classmethod
    def config_problems(cls, section: Mapping[str, Any]) -> list[str]:
        """Unknown part names and keys (with the closest valid one), wrong types, and what building the parts'
        structure (no weights, no files) refuses: image sizes, feature layers, presets; all of the section a
        published folder in ``pretrained`` completes (``settings_from_published``), as ``from_config`` builds it."""
        # Checked as the build sees it: with what a published folder brings (its tokenizer, LLM architecture, ...).
        problems = []
        pretrained = section.get("pretrained")
        if section.get("load_pretrained") and pretrained and Path(pretrained).expanduser().exists():
            try:
                section = cls.published_settings(cls._with_parts(section))
            except PartError as e:
                problems.append(str(e))
        problems = super().config_problems(section) + problems
        part_problems = cls.part_schema_problems(section)
        if part_problems or any(not Path(p).expanduser().exists() for p in cls._part_files(section).values()):
            return problems + part_problems  # a missing file is reported by the file check, once
        try:
            cls._geometry_of(section)
        except (PartError, ValueError, TypeError) as e:
            # A part names its own keys (`vision_tower.image_size`); here they sit in the model section.
            message = str(e)
            problems.append(f"model.{message}" if message.startswith(tuple(f"{k}." for k in PART_KINDS)) else message)
        return problems

    @classmethod
    def part_schema_problems(cls, section: Mapping[str, Any]) -> list[str]:
        """Each part section's name looked up and its keys and types checked against the part's class."""
        problems: list[str] = []
        for key, given in zip(PART_KINDS, cls.part_sections(section)):
            problems += _part_section_problems(PART_KINDS[key], given, f"model.{key}")
        return problems

    @classmethod
    def tokens_per_image_of(cls, section: Mapping[str, Any]) -> int:
        """What the connector makes of the tower's tokens (the parts' structure built on the meta device)."""
        return cls._geometry_of(section).tokens_per_image

    @classmethod
    def image_size_of(cls, section: Mapping[str, Any]) -> int | None:
        """The side the tower takes (its preset's, a published folder's config.json, or its ``image_size``)."""
        try:
            return cls._geometry_of(section).image_size
        except (PartError, ValueError, TypeError, KeyError):
            return None  # config_problems reports why

    @classmethod
    def image_processing_of(cls, section: Mapping[str, Any]) -> ImageProcessing | None:
        """The tower's ``processing`` (size, mean/std, resize, padding), from its section alone: the structure built
        on the meta device, a published folder's config.json read, no weights; with what a published folder in
        ``pretrained`` fixes (a Qwen-VL processor's pixel bounds and video sampling), as ``from_config`` builds it,
        so that the datasets' processors are filled with the processing the model is built with."""
        try:
            section = cls.published_settings(cls._with_parts(section))
        except PartError:
            pass  # config_problems reports the folder
        try:
            return cls._geometry_of(section).processing
        except (PartError, ValueError, TypeError, KeyError):
            return None  # config_problems reports why

    @classmethod
    def _geometry_of(cls, section: Mapping[str, Any]) -> "Geometry":
        return _geometry(*(json.dumps(s, sort_keys=True, default=str) for s in cls.part_sections(section)), cls)

    @classmethod
    def files_of(cls, section: Mapping[str, Any]) -> dict[str, str]:
        """The LLM side's files and ``pretrained``, plus the parts' (``vision_tower.pretrained``, ...)."""
        return {**super().files_of(section), **cls._part_files(section)}

    @classmethod
    def _part_files(cls, section: Mapping[str, Any]) -> dict[str, str]:
        files = {}
        for key, part in zip(PART_KINDS, cls.part_sections(section)):
            for file_key in ("pretrained", "qformer_tokenizer"):
                if isinstance(part.get(file_key), str) and part[file_key]:
                    files[f"{key}.{file_key}"] = part[file_key]
        return files


def _part_section_problems(kind: Registry, section: Mapping[str, Any], path: str) -> list[str]:
    """The part's name looked up (did-you-mean), its keys and their types checked against its class."""
    if "name" not in section:
        return [f"{path}.name: required; known {kind.kind}s: {', '.join(kind)}"]
    try:
        cls = kind.get(section["name"])
    except KeyError as e:
        return [f"{path}.name: {e.args[0]}"]
    schema = {k: v for k, v in fields_of(cls).items() if k not in ("vision_width", "llm_width")}
    errors: list[str] = []
    check_section({k: v for k, v in section.items() if k != "name"}, schema, path, errors,
                  extra_keys=PART_EXTRA_KEYS, require=False)
    errors += [f"{path}.{k}: set by the architecture (the tower's and the LLM's widths); leave it out"
               for k in ("vision_width", "llm_width") if k in section]
    return errors


class Geometry(NamedTuple):
    """What the config side knows of a tower and connector pair without building it (a flat-feature tower's image
    size and tokens per image: None, each image has its own)."""

    image_size: int | None
    tokens_per_image: int | None
    processing: ImageProcessing | Any


@functools.lru_cache(maxsize=64)
def _geometry(tower_json: str, connector_json: str, arch: type) -> Geometry:
    """The image size, tokens per image and tower processing of a tower and connector section, their structure
    built on the meta device (no memory, no weights; a published tower folder's config.json is read). Connector
    files (a tokenizer) are not read: the constructor never reads them."""
    tower_section, connector_section = json.loads(tower_json), json.loads(connector_json)
    check_layouts(arch, tower_section, connector_section)
    tower_cls = vision_towers.get(tower_section.pop("name"))
    connector_cls = connectors.get(connector_section.pop("name"))
    pretrained = tower_section.pop("pretrained", None)
    tower_section.pop("freeze", None)
    for key in ("pretrained", "freeze"):
        connector_section.pop(key, None)
    with torch.device("meta"):
        tower = (tower_cls.from_folder(pretrained, tower_section, "model.vision_tower") if pretrained
                 else tower_cls(**tower_section))
        connector = connector_cls(vision_width=tower.num_features, llm_width=8, **connector_section)
    tokens = None if tower.num_tokens is None else connector.tokens_per_image(tower.num_tokens)
    return Geometry(tower.image_size, tokens, tower.processing)
