"""The config side of a vision-LLM composed of registered parts (``models.vision_llm.VisionLLM``): its
``vision_tower:`` and ``connector:`` sections looked up and checked, and what the tower and connector make of an
image (size, tokens, processing), read from their structure built on the meta device (no weights, no memory).

Rules the constructor also enforces are functions here that both call (``given_part_sections``,
``check_layouts``)."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.common.registry import Registry, connectors, vision_towers
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.models.parts import PartError
from lavis_ds.models.published import settings_from_published
from lavis_ds.models.settings.base import constructor_arguments
from lavis_ds.models.settings.vision_llm import VisionLLMSettings
from lavis_ds.processors.image import ImageProcessing

# The keys of the model section that hold a part's section, and the registry each part's name is looked up in.
PART_KINDS: dict[str, Registry] = {"vision_tower": vision_towers, "connector": connectors}
# Keys a part section takes besides its class's constructor arguments (``parts.build_part``).
PART_EXTRA_KEYS = ("name", "pretrained", "freeze")
# What reading a part's structure may raise: each names the key at fault (reported by ``problems``).
PART_FAULTS = (PartError, ValueError, TypeError, KeyError)


class Geometry(NamedTuple):
    """What the config side knows of a tower and connector pair without building it (a flat-feature tower's image
    size and tokens per image: None, each image has its own)."""

    image_size: int | None
    tokens_per_image: int | None
    processing: ImageProcessing | Any


class ComposedSettings(VisionLLMSettings):
    """A ``model:`` section with a ``vision_tower:`` and a ``connector:`` section (the architecture's defaults where
    left out) and the LLM's keys."""

    # The part sections an architecture uses when the config leaves one out (subclasses override).
    DEFAULT_PARTS: dict[str, dict[str, Any]] = {"vision_tower": {"name": "clip"}, "connector": {"name": "mlp2x_gelu"}}
    # A dataset that names no image processor gets the tower's own processing (filled in by the config loader).
    IMAGE_PROCESSORS = {"train": "tower_image_train", "eval": "tower_image_eval"}
    # Whether the architecture takes parts with flat features of images of their own sizes (``FLAT_FEATURES``: the
    # Qwen-VL towers and patch_merger) instead of fixed-size towers and connectors.
    FLAT_FEATURES = False

    def arguments(self) -> dict[str, Any]:
        """The constructor's arguments, with what a published folder in ``pretrained`` fixes (its image token)."""
        try:
            section = self.with_published()
        except PartError:
            section = self.section  # problems() reports the folder
        return constructor_arguments(self.arch, section)

    def with_published(self) -> dict[str, Any]:
        """The section, both part sections present, with the settings a published folder in ``pretrained`` fixes
        (``models.published.settings_from_published``): what ``from_config`` builds."""
        return settings_from_published(self._with_parts())

    def part_sections(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tower's and the connector's sections the ``model:`` section describes (an architecture with keys of
        its own for them translates those)."""
        return given_part_sections(self.DEFAULT_PARTS, self.section)

    def _with_parts(self) -> dict[str, Any]:
        """The section with both part sections present (the architecture's defaults where left out)."""
        return {**self.section, **dict(zip(PART_KINDS, self.part_sections()))}

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

    def problems(self) -> list[str]:
        """Unknown part names and keys (with the closest valid one), wrong types, and what building the parts'
        structure (no weights, no files) refuses: image sizes, feature layers, presets; all of the section a
        published folder in ``pretrained`` completes, as ``from_config`` builds it."""
        settings, problems = self, []
        pretrained = self.section.get("pretrained")
        if self.section.get("load_pretrained") and pretrained and Path(pretrained).expanduser().exists():
            try:  # checked as the build sees it: with what a published folder brings (its tokenizer, LLM, ...)
                settings = self._for_section(self.with_published())
            except PartError as e:
                problems.append(str(e))
        problems = VisionLLMSettings.problems(settings) + problems
        part_problems = settings.part_problems()
        if part_problems or any(not Path(p).expanduser().exists() for p in settings._part_files().values()):
            return problems + part_problems  # a missing file is reported by the file check, once
        try:
            settings.geometry()
        except (PartError, ValueError, TypeError) as e:
            # A part names its own keys (`vision_tower.image_size`); here they sit in the model section.
            message = str(e)
            problems.append(f"model.{message}" if message.startswith(tuple(f"{k}." for k in PART_KINDS)) else message)
        return problems

    def part_problems(self) -> list[str]:
        """Each part section's name looked up and its keys and types checked against the part's class."""
        problems: list[str] = []
        for key, given in zip(PART_KINDS, self.part_sections()):
            problems += part_section_problems(PART_KINDS[key], given, f"model.{key}")
        return problems

    def tokens_per_image(self) -> int | None:
        """What the connector makes of the tower's tokens (the parts' structure built on the meta device)."""
        return self.geometry().tokens_per_image

    def image_size(self) -> int | None:
        """The side the tower takes (its preset's, a published folder's config.json, or its ``image_size``)."""
        try:
            return self.geometry().image_size
        except PART_FAULTS:
            return None  # problems() reports why

    def image_processing(self) -> ImageProcessing | None:
        """The tower's ``processing`` (size, mean/std, resize, padding), from its section alone: the structure built
        on the meta device, a published folder's config.json read, no weights; with what a published folder in
        ``pretrained`` fixes (a Qwen-VL processor's pixel bounds and video sampling), as ``from_config`` builds it,
        so that the datasets' processors are filled with the processing the model is built with."""
        try:
            settings = self._for_section(self.with_published())
        except PartError:
            settings = self  # problems() reports the folder
        try:
            return settings.geometry().processing
        except PART_FAULTS:
            return None  # problems() reports why

    def geometry(self) -> Geometry:
        """The tower's image size, tokens per image and processing, its structure and the connector's built on the
        meta device (cached per pair of part sections)."""
        return _geometry(*(json.dumps(s, sort_keys=True, default=str) for s in self.part_sections()),
                         self.FLAT_FEATURES)

    def files(self) -> dict[str, str]:
        """The LLM side's files and ``pretrained``, plus the parts' (``vision_tower.pretrained``, ...)."""
        return {**super().files(), **self._part_files()}

    def _part_files(self) -> dict[str, str]:
        files = {}
        for key, part in zip(PART_KINDS, self.part_sections()):
            for file_key in ("pretrained", "qformer_tokenizer"):
                if isinstance(part.get(file_key), str) and part[file_key]:
                    files[f"{key}.{file_key}"] = part[file_key]
        return files


class InstructBlipSettings(ComposedSettings):
    """InstructBLIP's parts: EVA-ViT-g and the instruction-aware Q-Former with its 32 queries."""

    DEFAULT_PARTS = {"vision_tower": {"name": "eva_vit_g"},
                     "connector": {"name": "instruct_qformer", "num_query_token": 32}}


def given_part_sections(defaults: Mapping[str, dict[str, Any]], section: Mapping[str, Any]
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``vision_tower`` and ``connector`` sections of ``section``, ``defaults``' where left out."""
    out = []
    for key in PART_KINDS:
        given = section.get(key)
        out.append(dict(given) if given is not None else dict(defaults[key]))
    return out[0], out[1]


def part_section_problems(kind: Registry, section: Mapping[str, Any], path: str) -> list[str]:
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


def check_layouts(flat_features: bool, tower: Mapping[str, Any], connector: Mapping[str, Any]) -> None:
    """Raise ``PartError`` where the tower, the connector and the architecture (``flat_features``: its
    ``FLAT_FEATURES``) differ in feature layout: fixed-size images ``[N, T, C]``, or flat patches of images of their
    own sizes."""
    for key, section, kind in (("vision_tower", tower, vision_towers), ("connector", connector, connectors)):
        name = section.get("name")
        part = kind.get(name) if name in kind else None
        if part is not None and part.FLAT_FEATURES != flat_features:
            own = "flat patch features of images of their own sizes" if part.FLAT_FEATURES else "fixed-size images"
            takes = "flat patch features" if flat_features else "fixed-size towers and connectors"
            flat = [n for n in kind if kind.get(n).FLAT_FEATURES == flat_features]
            raise PartError(f"{key}.name: {name} works on {own}, but this architecture takes {takes}: valid here: "
                            f"{', '.join(flat)}")


def tokens_per_image(tower: nn.Module, connector: nn.Module) -> int | None:
    """LLM tokens per image the connector makes of the tower's; None for a flat-feature tower, which has no count
    per image (its layout's ``tokens_for_image`` says it per image size)."""
    return None if tower.num_tokens is None else connector.tokens_per_image(tower.num_tokens)


def structure_on_meta(tower_section: Mapping[str, Any], connector_section: Mapping[str, Any]) -> tuple[Any, Any]:
    """The tower and the connector of two part sections, built on the meta device as the build makes them (its
    presets and defaults filled in; a published tower folder's config.json is read, connector files are not: the
    constructor never reads them)."""
    tower_section, connector_section = dict(tower_section), dict(connector_section)
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
    return tower, connector


@functools.lru_cache(maxsize=64)
def _geometry(tower_json: str, connector_json: str, flat_features: bool) -> Geometry:
    """The image size, tokens per image and tower processing of a tower and connector section (``structure_on_meta``:
    no memory, no weights)."""
    tower_section, connector_section = json.loads(tower_json), json.loads(connector_json)
    check_layouts(flat_features, tower_section, connector_section)
    tower, connector = structure_on_meta(tower_section, connector_section)
    return Geometry(tower.image_size, tokens_per_image(tower, connector), tower.processing)
