"""Qwen3-VL as a transformers class (the ``qwen3_vl`` family): its published folders load into the ``qwen3_vl``
architecture, part for part, and ``--format hf`` writes one back.

    model.visual.* (without mergers)          <- vision_tower (``towers.qwen3_vl``: transformers' names)
    model.visual.merger.*                     <- connector.merger (``qwen3_vl_merger``)
    model.visual.deepstack_merger_list.N.*    <- connector.deepstack_merger_list.N
    model.language_model.* / model.*          <- llm_model.model (``qwen_vl_text``: Qwen3-VL's text model)
    lm_head.*                                 <- llm_model.lm_head

What Qwen2-VL's family does holds otherwise (``hf.qwen_vl``: the folder's vision config, pixel bounds, text config,
tokenizer, chat template's vision tokens); the folder also fixes the connector's DeepStack mergers (one per
``deepstack_visual_indexes``) and the tower's video sampling (its video processor's ``fps`` and ``size``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.hf.family import part_name
from lavis_ds.models.hf.qwen_vl import (QwenVLFamily, QwenVLFolders, QwenVLProcessors, QwenVLWeights,
                                       processor_settings, saved_processor)
from lavis_ds.models.parts import PartError


class Qwen3VLWeights(QwenVLWeights):
    def merger_state(self, connector: nn.Module) -> dict[str, torch.Tensor]:
        """The connector's keys are the class's own under ``model.visual`` (``merger.*``,
        ``deepstack_merger_list.*``)."""
        return dict(connector.state_dict())


class Qwen3VLProcessors(QwenVLProcessors):
    def processor(self, model: nn.Module, image_processor, tokenizer, template: str):
        """``Qwen3VLProcessor`` around the image processor, the tokenizer and template, and Qwen3-VL's video
        processor with the tower's patch sizes, normalisation and video sampling (its rate, frame bounds and pixel
        budget; the per-frame cap off, as training samples)."""
        from transformers import Qwen3VLProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        processing = model.vision_tower.processing
        settings = processor_settings(processing)
        video = Qwen3VLVideoProcessor(image_mean=settings["image_mean"], image_std=settings["image_std"],
                                      patch_size=settings["patch_size"], merge_size=settings["merge_size"],
                                      temporal_patch_size=settings["temporal_patch_size"], fps=processing.video_fps,
                                      min_frames=processing.video_min_frames, max_frames=processing.video_max_frames,
                                      size={"shortest_edge": processing.video_min_pixels,
                                            "longest_edge": processing.video_max_pixels},
                                      cap_pixels_per_frame=False)
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                                video_processor=video)


class Qwen3VLFolders(QwenVLFolders):
    def published_settings(self, section: dict[str, Any], folder: Path, config: Any) -> dict[str, Any]:
        """As Qwen2-VL's, with the folder's video sampling (rate and pixel budget) where the section sets none; the
        configured architecture must be the folder's."""
        settings = super().published_settings(section, folder, config)
        tower = settings["vision_tower"]
        tower.update({k: v for k, v in video_sampling(folder).items() if tower.get(k) is None})
        arch, family = section.get("arch"), self.family
        if arch is not None and arch != family.arch:
            raise PartError(f"model.pretrained: {folder} is a {family.hf_class} folder (config.json model_type "
                            f"{family.model_type!r}), but model.arch is {arch!r}; load it with model.arch: "
                            f"{family.arch} ({family.exportable})")
        return settings

    def fit_problems(self, model: nn.Module, config: Any) -> list[str]:
        name = part_name(model, reg.models)
        if name != self.family.arch:
            return [f"architecture: the folder's is {self.family.arch}, the model's {name}"]
        return super().fit_problems(model, config)

    def connector_settings(self, config: Any) -> dict[str, Any]:
        """One DeepStack merger per tapped tower block."""
        return {"deepstack_taps": len(config.vision_config.deepstack_visual_indexes)}

    def merger_problems(self, model: nn.Module, config: Any) -> list[str]:
        ours, theirs = model.connector.deepstack_taps, len(config.vision_config.deepstack_visual_indexes)
        return [] if ours == theirs else [f"qwen3_vl_merger deepstack_taps: folder {theirs}, model {ours}"]


class Qwen3VLFamily(QwenVLFamily):
    hf_class, model_type, tower = "Qwen3VLForConditionalGeneration", "qwen3_vl", "qwen3_vl"
    # Qwen3.5's class holds the same parts (``hf.qwen3_5``): the architecture says which class a model exports to,
    # and which architecture reads a folder.
    arch = "qwen3_vl"
    out_width_key = "out_hidden_size"
    pairs = (("qwen3_vl", "qwen3_vl_merger"),)
    exportable = "a qwen3_vl tower + qwen3_vl_merger + the qwen3_vl_text model"

    def __init__(self, weights: type[Qwen3VLWeights] = Qwen3VLWeights,
                 processors: type[Qwen3VLProcessors] = Qwen3VLProcessors,
                 folders: type[Qwen3VLFolders] = Qwen3VLFolders):
        super().__init__(weights, processors, folders)


reg.hf_families.register("qwen3_vl")(Qwen3VLFamily())


def video_sampling(folder: Path) -> dict[str, Any]:
    """The tower's ``video_fps`` / ``video_min_pixels`` / ``video_max_pixels`` from the folder's video processor,
    where it has one (``saved_processor``)."""
    saved = saved_processor(folder, "video_preprocessor_config.json", "video_processor")
    size = saved.get("size") or {}
    found = {"video_fps": saved.get("fps"), "video_min_pixels": size.get("shortest_edge"),
             "video_max_pixels": size.get("longest_edge")}
    return {k: (float(v) if k == "video_fps" else int(v)) for k, v in found.items() if v is not None}
