"""The three parts an :class:`~lavis_ds.models.hf.family.HfFamily` holds, one job each, with what most classes do.

A family builds each part in its ``__init__`` from the part's class, handing it the record (``self.family``: the
class's names for messages, its pairs). A family module subclasses the parts whose answers its class changes:

- :class:`WeightsExport`: the model's weights as the transformers class (checks, the model, notes);
- :class:`ProcessorExport`: the processor written beside them (image processor, chat template's image text,
  processor, the written folder's changes and checks, the one call's notes);
- :class:`FolderReading`: published folders of the class read back (settings, fit, the parts' keys).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lavis_ds.common.registry import connectors
from lavis_ds.models.hf.family import HfFamily, State, part_name
from lavis_ds.models.parts import PartError


class FamilyPart:
    """A part of one family record."""

    def __init__(self, family: HfFamily):
        self.family = family

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.family.hf_class})"


class WeightsExport(FamilyPart):
    """How a lavis_ds model becomes the class's transformers model."""

    def export_problems(self, model: nn.Module) -> list[str]:  # pragma: no cover - interface
        """Everything of ``model`` (merged, weights loaded) the class cannot express, each one line."""
        raise NotImplementedError(f"{type(self).__name__} must define it: every registered family exports")

    def to_hf_model(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:  # pragma: no cover - interface
        """The transformers model holding ``model``'s weights in ``dtype``, every key accounted for."""
        raise NotImplementedError(f"{type(self).__name__} must define it: every registered family exports")

    def export_notes(self, model: nn.Module, dtype: torch.dtype) -> list[str]:
        """Where the exported model computes differently though every weight is the same (beyond the dtype)."""
        return []


class ProcessorExport(FamilyPart):
    """The class's processor of a model: what ``AutoProcessor.from_pretrained`` of the export gives."""

    # Whether the class's processor keeps the chat template it is saved with (``processor.apply_chat_template``);
    # Blip2Processor and InstructBlipProcessor drop it (the tokenizer keeps it).
    processor_keeps_chat_template: bool = True
    # Whether the class's image processor reproduces a square resize only (no crop, no padding).
    square_images_only: bool = False

    def image_processor(self, processing) -> Any:  # pragma: no cover - interface
        """The transformers image processor (PIL backend) doing what ``processing`` (an ``ImageProcessing``) does."""
        raise NotImplementedError(f"{type(self).__name__} must define it: every registered family exports")

    def processor(self, model: nn.Module, image_processor: Any, tokenizer: Any,
                  template: str) -> Any:  # pragma: no cover - interface
        """The class's processor of ``model`` around its image processor, tokenizer and chat template."""
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

    def finish_processor_folder(self, model: nn.Module, folder: Path) -> None:
        """Change what the class's processor needs changed in the saved ``folder`` (nothing by default)."""

    def check_exported_processor(self, model: nn.Module, out: Path, processing: Any) -> None:
        """Refuse (ExportError) a processor written to ``out`` that prompts otherwise than training does with
        ``processing``, where the class's processor computes counts of its own. Default: nothing to check."""

    def one_call_notes(self, model: nn.Module) -> list[str]:
        """Where ``processor(images=..., text=...)`` + ``model.generate(**inputs)`` on the export (what lmms-eval,
        vLLM and model cards call) prepare or generate otherwise than lavis_ds on the checkpoint; the export's
        README.md lists them."""
        return []


class FolderReading(FamilyPart):
    """A folder of the class (``save_pretrained``) read back: as a composed model's ``pretrained:`` (where
    ``reads_published``), and as a tower's published weights."""

    # Whether a composed model's ``pretrained:`` reads a folder of this class (tower, connector and LLM).
    reads_published: bool = False
    # The keys of the folder's safetensors that hold the vision tower and the LLM (``tower_state``, ``llm_state``
    # rename them).
    tower_prefixes: tuple[str, ...] = ()
    llm_prefixes: tuple[str, ...] = ("language_model.", "model.language_model.", "lm_head.")

    def published_settings(self, section: dict[str, Any], folder: Path, config: Any) -> dict[str, Any]:
        """``section`` with what a folder of this class fixes beyond the LLM, tokenizer and image token (which
        ``models.published`` reads for every family)."""
        return section

    def fit_problems(self, model: nn.Module, config: Any) -> list[str]:
        """What of the configured ``model``'s image path differs from the folder's (``config``), each one line."""
        return []

    def connector_problems(self, model: nn.Module) -> list[str]:
        """The model's connector against the ones the class holds."""
        wanted = sorted({connector for _, connector in self.family.pairs})
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
        raise PartError(f"a {self.family.hf_class} folder's vision tower is not a transformers vision model")

    def llm_state(self, state: State) -> dict[str, torch.Tensor]:
        """The folder's language model keyed as its ``AutoModelForCausalLM`` (``model.*``, ``lm_head.*``)."""
        from lavis_ds.models import hf_keys

        return hf_keys.llava_llm(state)
