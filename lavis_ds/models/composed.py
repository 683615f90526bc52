"""A vision-LLM composed of registered parts: a vision tower, a connector, and the chat LLM of ``VisionLLM``.

The model holds its parts as fields, each built from one config section named after its registry kind::

    vision_tower: {name: clip, preset: vit_l_14_336, vision_feature_layer: -2}
    connector: {name: mlp2x_gelu}

(see ``lavis_ds.models.parts``). The image path is ``connector(vision_tower(images), connector inputs)``;
an instruction-aware connector (InstructBLIP's Q-Former) gets its inputs from ``connector.prepare``, which
``prepare_batch`` runs on the host (``batch_fields``). Registered architectures (``llava``, ``instructblip``)
are subclasses that only name their default parts, presets and published-checkpoint formats; any tower
with any connector trains by YAML (``arch: llava`` with ``vision_tower: {name: siglip}`` and
``connector: {name: qformer}``).

Its datasets get the tower's own image processing (its settings' ``IMAGE_PROCESSORS``: ``tower_image_train`` /
``tower_image_eval``, their keys filled from ``image_processing()`` when the config is loaded;
``lavis_ds.image_config``).
What a ``model:`` section means without building it is its settings class's (``SETTINGS``:
``lavis_ds.models.settings.composed``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lavis_ds.common.registry import connectors, vision_towers
from lavis_ds.models.parts import build_part
from lavis_ds.models.prompt import image_counts
from lavis_ds.models.published import load_published
from lavis_ds.models.settings.base import model_settings
from lavis_ds.models.settings.composed import ComposedSettings, check_layouts, given_part_sections
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.models.vision_llm_batch import packed_image_order

# The fields of an instruction connector's inputs that travel in a prepared batch (one row per image).
CONNECTOR_INPUT_KEYS = ("qformer_input_ids", "qformer_attention_mask")


class ComposedVisionLLM(VisionLLM):
    """``vision_tower`` -> ``connector`` -> image tokens spliced into ``llm_model``; subclasses name defaults."""

    SETTINGS = ComposedSettings
    CONNECTOR_PREFIXES = ("connector.",)
    PER_IMAGE_FIELDS = CONNECTOR_INPUT_KEYS

    def __init__(self, *, vision_tower: dict[str, Any] | None = None, connector: dict[str, Any] | None = None,
                 **llm_args: Any):
        """
        Args:
            vision_tower: The tower's section: ``name`` (a registered tower: ``clip``, ``siglip``,
                ``eva_vit_g``, ...) plus its keys, ``pretrained`` (published weights) and ``freeze``
                (default true). Left out: the architecture's default tower.
            connector: The connector's section: ``name`` (``mlp2x_gelu``, ``linear``, ``qformer``,
                ``instruct_qformer``, ...) plus its keys, ``pretrained`` and ``freeze`` (default false). Its
                widths come from the tower and the LLM.
            **llm_args: The LLM side's arguments (``VisionLLM``: ``llm_model``, ``tokenizer``, ``get_lora``, ...).
        """
        super().__init__(**llm_args)
        tower_section, connector_section = given_part_sections(self.SETTINGS.DEFAULT_PARTS,
                                                               {"vision_tower": vision_tower, "connector": connector})
        check_layouts(self.SETTINGS.FLAT_FEATURES, tower_section, connector_section)
        self.vision_tower = build_part(vision_towers, tower_section, "model.vision_tower")
        llm_width = self.build_llm()
        self.connector = build_part(connectors, connector_section, "model.connector",
                                    vision_width=self.vision_tower.num_features, llm_width=llm_width)
        self.image_size = self.vision_tower.image_size
        # A flat-feature tower has no count per image: tokens_for_image says it per image size.
        self.tokens_per_image = None if self.vision_tower.num_tokens is None \
            else self.connector.tokens_per_image(self.vision_tower.num_tokens)
        self.finish_build()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DictConfig) -> "ComposedVisionLLM":
        """Build from a ``model:`` section; a published folder in ``pretrained`` (with ``load_pretrained``) first
        gives the settings that come with its weights (``models.published.settings_from_published``)."""
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        return super().from_config(model_settings(cls, cfg).with_published())

    def load_from_pretrained(self, path: str) -> None:
        """A ``LlavaForConditionalGeneration`` or ``InstructBlipForConditionalGeneration`` folder (every part),
        LAVIS's InstructBLIP ``.pth`` or LLaVA's stage-1 ``mm_projector.bin`` (the parts it holds); each part
        checked against the configured one (``lavis_ds.models.published``)."""
        load_published(self, path)

    # ----------------------------------------------------------------- the image path
    def vision_blocks(self) -> list[nn.Module]:
        """The tower's blocks, then the connector's (a Q-Former's layers)."""
        return [*self.vision_tower.blocks(), *self.connector.blocks()]

    def batch_fields(self, samples: dict[str, Any]) -> dict[str, Any]:
        """An instruction connector's inputs, tokenized on the host: one row per image in sample order, or one
        empty instruction for the blank stand-in image of a batch without images."""
        if not self.connector.NEEDS_INSTRUCTION:
            return {}
        if sum(image_counts(samples)):
            return self.connector.prepare(samples)
        blank = self.blank_images(torch.device("cpu"))  # what image_embeds feeds the tower
        return self.connector.prepare({"instruction": [""], "num_images": [1], **blank})

    def encode_images(self, images: torch.Tensor, samples: dict[str, Any]) -> torch.Tensor:
        """``connector(vision_tower(images), inputs)``; the connector's inputs follow the images into packed order."""
        inputs = None
        if self.connector.NEEDS_INSTRUCTION:
            inputs = {k: samples[k] for k in CONNECTOR_INPUT_KEYS if k in samples} or self.batch_fields(samples)
            rows = inputs["qformer_input_ids"].shape[0]
            if rows != images.shape[0]:
                raise ValueError(f"{rows} instruction rows for {images.shape[0]} images: prepare_batch makes one per "
                                 "image (the blank stand-in image of an image-free batch has one too)")
            if "position_ids" in samples and rows == sum(image_counts(samples)) and rows > 1:
                order = packed_image_order(samples)
                inputs = {k: v[order.to(v.device)] for k, v in inputs.items()}
            inputs = {k: v.to(images.device) for k, v in inputs.items()}
        return self.connector(self.vision_tower(images), inputs)
