"""A transformers vision-LLM class as one registered record: how lavis_ds exports to it and reads its folders back.

transformers maps a config class to its model class in one table and keeps each family's key renames beside the
family (``_checkpoint_conversion_mapping``); lavis_ds does the same. Each family is an :class:`HfFamily` instance
registered in ``registry.hf_families`` by the module that defines it (``lavis_ds.models.hf.blip``,
``lavis_ds.models.hf.llava``, ...). The record names its class (``hf_class``, the folder's ``config.json``
``model_type``, the lavis_ds models it holds: ``pairs``, ``holds``) and holds one part per job, each built in its
``__init__`` (interfaces in ``lavis_ds.models.hf.family_parts``):

- ``weights`` (:class:`~lavis_ds.models.hf.family_parts.WeightsExport`): what of a model the class cannot express
  (``export_problems``), the transformers model holding the model's weights (``to_hf_model``) and what the export
  computes differently (``export_notes``);
- ``processors`` (:class:`~lavis_ds.models.hf.family_parts.ProcessorExport`): its image processor and processor, the
  chat template's image text, what it changes in and checks of the written folder, and what the ecosystem's one call
  on it does otherwise (``one_call_notes``);
- ``folders`` (:class:`~lavis_ds.models.hf.family_parts.FolderReading`): published loading: the settings a folder
  brings (``published_settings``), what of the configured model must match the folder (``fit_problems``) and where
  the parts' weights sit in it (``tower_state``, ``llm_state``).

The shared code (``lavis_ds.apps.export_hf*``, ``lavis_ds.models.published``, the towers) asks the family's parts and
never compares names, so a new family is one module that registers one record (docs/export-hf.md, "Adding a
family").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lavis_ds.common.registry import Registry, connectors, hf_families, models, vision_towers
from lavis_ds.models.parts import PartError

State = Mapping[str, torch.Tensor]
# What the one call's image processor does otherwise, for families whose processors lavis_ds builds on the PIL backend.
TORCHVISION_BACKEND_NOTE = (
    "`AutoProcessor.from_pretrained(folder)` loads the image processor with transformers' torchvision backend, whose "
    "bicubic resize of a uint8 tensor lands up to one grey level away from lavis_ds's (PIL's) resize; "
    "`AutoProcessor.from_pretrained(folder, backend=\"pil\")` gives lavis_ds's pixels exactly")


class HfFamily:
    """One transformers vision-LLM class: subclasses fill in the data and name their parts' classes."""

    hf_class: str = ""  # the transformers class, e.g. "LlavaForConditionalGeneration"
    model_type: str = ""  # its config.json model_type, e.g. "llava"
    # (vision tower, connector) registry names of the composed models the class holds.
    pairs: tuple[tuple[str, str], ...] = ()
    # The architecture whose models the class holds; None: any with one of the pairs. Qwen3.5's class holds the same
    # parts as Qwen3-VL's, so the pair of parts alone does not say which class a model exports to.
    arch: str | None = None
    exportable: str = ""  # what the class holds, in words, for refusal messages
    # Connector name -> why no class of this family holds it (a pair that looks close; refusal messages).
    why_not: Mapping[str, str] = {}

    def __init__(self, weights: type, processors: type, folders: type):
        """Build the parts from their classes (``family_parts``'s ``WeightsExport``, ``ProcessorExport`` and
        ``FolderReading`` or subclasses), each handed this record. The parts' module imports this one, not the
        other way round."""
        self.weights = weights(self)
        self.processors = processors(self)
        self.folders = folders(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hf_class})"

    def holds(self, model: nn.Module) -> bool:
        """Whether ``model`` is one of the (tower, connector) pairs the class holds (of its architecture, if set)."""
        if not hasattr(model, "vision_tower"):
            return False
        pair = (part_name(model.vision_tower, vision_towers), part_name(model.connector, connectors))
        return pair in self.pairs and (self.arch is None or part_name(model, models) == self.arch)

    def exports(self) -> str:
        """What the class holds, for messages."""
        return f"{self.hf_class}: {self.exportable}"


# ----------------------------------------------------------------- lookups
def exporting_family(model: nn.Module) -> HfFamily | None:
    """The family whose class holds ``model`` (None: no transformers class does; the caller says why)."""
    return next((family for family in all_families() if family.holds(model)), None)


def all_families() -> list[HfFamily]:
    return [hf_families.get(name) for name in hf_families]


def folder_model_type(folder: str | Path) -> str | None:
    """The ``model_type`` of a folder's config.json (None: no config.json)."""
    config = Path(folder).expanduser() / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


def family_of_model_type(model_type: str | None) -> HfFamily | None:
    """The family whose class writes ``model_type`` folders (None: none does)."""
    return next((family for family in all_families() if family.model_type == model_type), None)


def published_family(folder: str | Path) -> HfFamily | None:
    """The family of a folder a composed model's ``pretrained:`` reads whole; None for a file (another format)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    model_type = folder_model_type(folder)
    family = family_of_model_type(model_type)
    if family is None or not family.folders.reads_published:
        what = f"a {model_type!r}" if model_type else "not a"
        raise PartError(f"model.pretrained: {folder} is {what} transformers folder"
                        f"{'' if model_type else ' (no config.json)'}; it takes {accepted_formats()}")
    return family


def accepted_formats() -> str:
    """What ``model.pretrained`` of a composed model takes, for messages."""
    folders = " or ".join(f.hf_class for f in all_families() if f.folders.reads_published)
    return f"a {folders} folder (save_pretrained), LAVIS's InstructBLIP .pth, or LLaVA's stage-1 mm_projector.bin"


# ----------------------------------------------------------------- what several families check alike
def part_name(part: nn.Module, kind: Registry) -> str:
    """The registry name of a tower or connector (exact class: a subclass may compute otherwise), else its class."""
    return next((name for name in kind if kind.get(name) is type(part)), type(part).__name__)


def llm_problems(llm: nn.Module, config_key: str = "text_config") -> list[str]:
    """The classes build the LLM with AutoModelForCausalLM from ``text_config`` (``config_key`` names it in the
    messages: "LlavaConfig's text_config"): it must build this very class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(getattr(llm, "config", None), "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return [f"llm_model: {type(llm).__name__} with config model_type {model_type!r}, which "
                f"AutoModelForCausalLM (what the {config_key} is built with) does not know"]
    built = MODEL_FOR_CAUSAL_LM_MAPPING[type(llm.config)]
    if built is not type(llm):
        return [f"llm_model: {type(llm).__name__}, but text_config model_type {model_type!r} builds {built.__name__}"]
    return []


def differences(part: str, theirs: Any, ours: Any, keys: tuple[str, ...]) -> list[str]:
    """``part key: folder X, model Y`` for each of ``keys`` whose values differ (``ours``: a config or a dict)."""
    get = (lambda c, k: c.get(k)) if isinstance(ours, dict) else getattr
    return [f"{part} {key}: folder {getattr(theirs, key, None)}, model {get(ours, key)}" for key in keys
            if getattr(theirs, key, None) != get(ours, key)]


def image_processor_settings(processing) -> dict[str, Any]:
    """The keyword arguments every transformers image processor takes for ``processing`` (an ``ImageProcessing``):
    bicubic resize, rescale to [0, 1], the tower's mean and std. The PIL backend resizes as torchvision's Resize does
    on a PIL image (PIL's own bicubic); transformers' default torchvision backend resizes a uint8 tensor and can land
    one grey level off (docs/export-hf.md: load the processor with ``backend="pil"``)."""
    from transformers.image_utils import PILImageResampling

    return dict(do_resize=True, resample=PILImageResampling.BICUBIC, do_rescale=True, rescale_factor=1 / 255,
                do_normalize=True, image_mean=list(processing.mean), image_std=list(processing.std),
                do_convert_rgb=True)
