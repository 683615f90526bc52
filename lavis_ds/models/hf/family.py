"""A transformers vision-LLM class as one registered record: how lavis_ds exports to it and reads its folders back.

transformers maps a config class to its model class in one table and keeps each family's key renames beside the
family (``_checkpoint_conversion_mapping``); lavis_ds does the same. Each family is an :class:`HfFamily` instance
registered in ``registry.hf_families`` by the module that defines it (``lavis_ds.models.hf.blip``,
``lavis_ds.models.hf.llava``). It says:

- export: which lavis_ds models its class holds (``holds``), what of such a model the class cannot express
  (``export_problems``), the transformers model holding the model's weights (``to_hf_model``), its image processor
  and processor (``image_processor``, ``processor``, ``finish_processor_folder``), and what the export computes
  differently (``export_notes``) and what the ecosystem's one call on it does otherwise (``one_call_notes``);
- published loading: the folder's ``config.json`` ``model_type``, the settings a folder brings
  (``published_settings``), what of the configured model must match the folder (``fit_problems``) and where the
  parts' weights sit in it (``tower_state``, ``llm_state``).

The shared code (``lavis_ds.apps.export_hf*``, ``lavis_ds.models.published``, the towers) asks the family and
never compares names, so a new family is one module that registers one record (docs/export-hf.md, "Adding a
family").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lavis_ds.common.registry import Registry, connectors, hf_families, vision_towers
from lavis_ds.models.parts import PartError

State = Mapping[str, torch.Tensor]
# What the one call's image processor does otherwise, for families whose processors lavis_ds builds on the PIL backend.
TORCHVISION_BACKEND_NOTE = (
    "`AutoProcessor.from_pretrained(folder)` loads the image processor with transformers' torchvision backend, whose "
    "bicubic resize of a uint8 tensor lands up to one grey level away from lavis_ds's (PIL's) resize; "
    "`AutoProcessor.from_pretrained(folder, backend=\"pil\")` gives lavis_ds's pixels exactly")


class HfFamily:
    """One transformers vision-LLM class; subclasses fill in the data and the methods their class needs."""

    hf_class: str = ""  # the transformers class, e.g. "LlavaForConditionalGeneration"
    model_type: str = ""  # its config.json model_type, e.g. "llava"
    # (vision tower, connector) registry names of the composed models the class holds.
    pairs: tuple[tuple[str, str], ...] = ()
    exportable: str = ""  # what the class holds, in words, for refusal messages
    # Connector name -> why no class of this family holds it (a pair that looks close; refusal messages).
    why_not: Mapping[str, str] = {}
    # Whether a composed model's ``pretrained:`` reads a folder of this class (tower, connector and LLM).
    reads_published: bool = False
    # Whether the class's processor keeps the chat template it is saved with (``processor.apply_chat_template``);
    # Blip2Processor and InstructBlipProcessor drop it (the tokenizer keeps it).
    processor_keeps_chat_template: bool = True
    # Whether the class's image processor reproduces a square resize only (no crop, no padding).
    square_images_only: bool = False
    # The keys of the folder's safetensors that hold the vision tower and the LLM (``tower_state``, ``llm_state``
    # rename them).
    tower_prefixes: tuple[str, ...] = ()
    llm_prefixes: tuple[str, ...] = ("language_model.", "model.language_model.", "lm_head.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hf_class})"

    # ----------------------------------------------------------------- export
    def holds(self, model: nn.Module) -> bool:
        """Whether ``model`` is one of the (tower, connector) pairs the class holds."""
        if not hasattr(model, "vision_tower"):
            return False
        return (part_name(model.vision_tower, vision_towers), part_name(model.connector, connectors)) in self.pairs

    def exports(self) -> str:
        """What the class holds, for messages."""
        return f"{self.hf_class}: {self.exportable}"

    def export_problems(self, model: nn.Module) -> list[str]:  # pragma: no cover - interface
        """Everything of ``model`` (merged, weights loaded) the class cannot express, each one line."""
        raise NotImplementedError(f"{type(self).__name__} must define it: every registered family exports")

    def to_hf_model(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:  # pragma: no cover - interface
        """The transformers model holding ``model``'s weights in ``dtype``, every key accounted for."""
        raise NotImplementedError(f"{type(self).__name__} must define it: every registered family exports")

    def export_notes(self, model: nn.Module, dtype: torch.dtype) -> list[str]:
        """Where the exported model computes differently though every weight is the same (beyond the dtype)."""
        return []

    def one_call_notes(self, model: nn.Module) -> list[str]:
        """Where ``processor(images=..., text=...)`` + ``model.generate(**inputs)`` on the export (what lmms-eval,
        vLLM and model cards call) prepare or generate otherwise than lavis_ds on the checkpoint; the export's
        README.md lists them."""
        return []

    def fp16_note(self) -> str:
        """What transformers keeps in fp32 when the class is loaded in fp16 (``_keep_in_fp32_modules``), if any."""
        return ""

    def image_processor(self, processing) -> Any:  # pragma: no cover - interface
        """The transformers image processor (PIL backend) doing what ``processing`` (an ``ImageProcessing``) does."""
        raise NotImplementedError(f"{type(self).__name__} must define it: every registered family exports")

    def template_image_tokens(self, model: nn.Module) -> int:
        """Image tokens the chat template writes per image (the processor expands them where its class does)."""
        return model.llm.prompt.num_image_tokens

    def export_chat_template(self, model: nn.Module) -> str | None:
        """The chat template the export's processor and tokenizer carry; None: lavis_ds's ChatML template of the
        model's prompt (``apps.export_hf_processor.chat_template``)."""
        return None

    def template_image_run(self, model: nn.Module) -> str | None:
        """What the chat template writes for an image item; None: lavis_ds's ``<Img>`` + image tokens + ``</Img> ``."""
        return None

    def template_video_run(self, model: nn.Module) -> str | None:
        """What the chat template writes for a video item (a family whose processor takes videos); None: nothing."""
        return None

    def processor(self, model: nn.Module, image_processor: Any, tokenizer: Any,
                  template: str) -> Any:  # pragma: no cover - interface
        """The class's processor of ``model`` around its image processor, tokenizer and chat template."""
        raise NotImplementedError(f"{type(self).__name__} must define it: every registered family exports")

    def finish_processor_folder(self, model: nn.Module, folder: Path) -> None:
        """Change what the class's processor needs changed in the saved ``folder`` (nothing by default)."""

    def check_exported_processor(self, model: nn.Module, out: Path, processing: Any) -> None:
        """Refuse (ExportError) a processor written to ``out`` that prompts otherwise than training does with
        ``processing``, where the class's processor computes counts of its own. Default: nothing to check."""

    # ----------------------------------------------------------------- published folders
    def published_settings(self, section: dict[str, Any], folder: Path, config: Any) -> dict[str, Any]:
        """``section`` with what a folder of this class fixes beyond the LLM, tokenizer and image token (which
        ``models.published`` reads for every family)."""
        return section

    def fit_problems(self, model: nn.Module, config: Any) -> list[str]:
        """What of the configured ``model``'s image path differs from the folder's (``config``), each one line."""
        return []

    def connector_problems(self, model: nn.Module) -> list[str]:
        """The model's connector against the ones the class holds."""
        wanted = sorted({connector for _, connector in self.pairs})
        name = part_name(model.connector, connectors)
        if name in wanted:
            return []
        return [f"connector: the folder's is {' or '.join(wanted)}, the model's {name}"]

    def tower_config(self, folder: Path) -> Any:
        """The transformers config of the folder's vision tower."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder).vision_config

    def tower_state(self, state: State) -> dict[str, torch.Tensor]:
        """The folder's vision tower keyed as a transformers vision model (CLIP, SigLIP) without ``vision_model.``."""
        raise PartError(f"a {self.hf_class} folder's vision tower is not a transformers vision model")

    def llm_state(self, state: State) -> dict[str, torch.Tensor]:
        """The folder's language model keyed as its ``AutoModelForCausalLM`` (``model.*``, ``lm_head.*``)."""
        from lavis_ds.models import hf_keys

        return hf_keys.llava_llm(state)


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
    if family is None or not family.reads_published:
        what = f"a {model_type!r}" if model_type else "not a"
        raise PartError(f"model.pretrained: {folder} is {what} transformers folder"
                        f"{'' if model_type else ' (no config.json)'}; it takes {accepted_formats()}")
    return family


def accepted_formats() -> str:
    """What ``model.pretrained`` of a composed model takes, for messages."""
    folders = " or ".join(f.hf_class for f in all_families() if f.reads_published)
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
