"""Qwen3-VL (``qwen3_vl``): the ``qwen3_vl`` tower, the ``qwen3_vl_merger`` connector, Qwen3-VL's text model, and
DeepStack between them.

Everything the Qwen-VL architectures share holds (``models.qwen_vl``: flat patches and a grid per image, the
prompt's ``<|vision_start|>``/``<|vision_end|>`` span, M-RoPE numbering of each image's grid of LLM tokens), with a
merged token of 32 px (16 px patches). DeepStack: the tower's blocks of ``deepstack_visual_indexes`` are tapped,
each tap merged by its own DeepStack merger, and the LLM adds the i-th merger's tokens to its hidden states at the
image positions after decoder layer i (transformers' ``Qwen3VLTextModel`` does, given ``deepstack_visual_embeds``
and ``visual_pos_masks``, which its image path's ``splice`` passes it with the input embeddings). The connector's
output carries the merged and DeepStack tokens side by side in the channels, so they follow the batch's image order
together.

transformers' ``Qwen3VLForConditionalGeneration`` holds the same parts (``model.visual`` with ``merger`` and
``deepstack_merger_list``, ``model.language_model``, ``lm_head``); its published folders load with
``load_pretrained`` and export with ``--format hf`` (``lavis_ds.models.hf.qwen3_vl``).

A video (a visual with ``second_per_grid_t``) goes through the tower whole, as transformers' ``get_video_features``
takes it, and is written as Qwen3-VL's processor writes it: inside the marker's vision span, each temporal patch
(frame group) after the text ``<{seconds:.1f} seconds>`` of its time, with its ``<|video_pad|>`` placeholders in a
span of its own (``models.frame_groups``); M-RoPE numbers each frame group as an image of one temporal patch, the
timestamp text between them (transformers' ``get_rope_index``). A frame group's time is the mean of its first
and last frame's times: each frame's number in its file over the file's frame rate, as transformers times them
(``video_frame_seconds``, from the dataset), or, for a batch without them, frames taken evenly at the sampled rate
from the video's start (``2 / second_per_grid_t`` frames a second). The tower's temporal patch must be Qwen3-VL's
2 frames (its settings' ``PROMPT_LAYOUT``).
"""
from __future__ import annotations

from typing import Any

import torch

from lavis_ds.common import registry as reg
from lavis_ds.common.errors import LavisDsError
from lavis_ds.models.image_tokens import SECONDS_KEY, image_sizes, per_sample, video_flags
from lavis_ds.models.parts import PartError
from lavis_ds.models.positions import Visual
from lavis_ds.models.prompt import image_counts
from lavis_ds.models.qwen_vl import GridImageLayout, GridImagePath, QwenVL
from lavis_ds.models.settings.qwen3_vl import Qwen3VLSettings


class FrameGroupImageLayout(GridImageLayout):
    """Qwen3-VL's: a video written frame group by frame group, each an image of one temporal patch after its
    timestamp (``models.frame_groups``)."""

    def visuals(self, samples: dict[str, Any]) -> list[Visual]:
        """As Qwen2-VL's, for images; a grid of more than one temporal patch without video seconds is refused (it
        has no frame times to write)."""
        flags = video_flags(samples)
        stills = [i for i, size in enumerate(image_sizes(samples)) if len(size) == 3 and int(size[0]) > 1
                  and not flags[i]]
        if stills:
            raise LavisDsError(f"qwen3_vl: image {stills[0]} of the batch has {image_sizes(samples)[stills[0]][0]} "
                               f"temporal patches (image_grid_thw row {list(image_sizes(samples)[stills[0]])}) but no "
                               f"{SECONDS_KEY}; Qwen3-VL writes a video's frame times, so give a video its "
                               f"{SECONDS_KEY} (the qwen_vl_image processor's video fields) or give still images")
        return super().visuals(samples)

    def runs(self, samples: dict[str, Any]) -> list[list[Visual]]:
        """Each video as its frame groups, each an image of one temporal patch (its own run after its timestamp)."""
        frames = []
        for mine in per_sample(self.visuals(samples), image_counts(samples)):
            runs = []
            for visual in mine:
                t, h, w = visual.grid
                runs += [Visual(h * w, (1, h, w))] * t
            frames.append(runs)
        return frames


class DeepStackImagePath(GridImagePath):
    """Qwen3-VL's: the tower's tapped blocks merged beside its last one, and the DeepStack tokens handed to the text
    model with the input embeddings."""

    LAYOUT = FrameGroupImageLayout

    def encode(self, images: torch.Tensor, samples: dict[str, Any]) -> torch.Tensor:
        """``[sum of tokens, (1 + taps) * llm_hidden]``: each image's merged tokens, then its DeepStack tokens."""
        features, taps = self.tower.forward_taps(*self.layout.patches_and_grid(images, samples))
        return self.connector(features, {"taps": taps})

    def splice(self, input_ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The merged tokens spliced in at the placeholders; the DeepStack tokens and the placeholders' positions as
        the text model's ``deepstack_visual_embeds`` and ``visual_pos_masks``."""
        merged, *deepstack = features.split(self.llm.config.hidden_size, dim=-1)
        embeds = self.embed(input_ids, merged)
        if not deepstack or merged.shape[0] == 0:
            return embeds, {}
        mask = torch.isin(input_ids, torch.tensor(self.llm.prompt.placeholder_ids, device=input_ids.device))
        return embeds, {"visual_pos_masks": mask, "deepstack_visual_embeds": [d.to(embeds.dtype) for d in deepstack]}


@reg.models.register("qwen3_vl")
class Qwen3VL(QwenVL):
    """Qwen3-VL: the ``qwen3_vl`` tower (learned positions, DeepStack taps), ``qwen3_vl_merger``, Qwen3-VL's text
    model taking the DeepStack features after its first layers."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "2b": "models/qwen3_vl/2b.yaml",
        "4b": "models/qwen3_vl/4b.yaml",
        "8b": "models/qwen3_vl/8b.yaml",
        "tiny": "models/qwen3_vl/tiny.yaml",
    }
    SETTINGS = Qwen3VLSettings
    IMAGE_PATH = DeepStackImagePath

    def __init__(self, **kwargs: Any):
        """As every architecture's; the build refuses what the config check does (``deepstack_problems``), for a
        model built without it, and a tower whose temporal patch is not the frame group the prompt times videos by."""
        super().__init__(**kwargs)
        problems = self.SETTINGS.deepstack_problems(list(getattr(self.vision_tower, "tap_layers", ())),
                                                    getattr(self.connector, "deepstack_taps", 0),
                                                    self.llm.config.num_hidden_layers)
        if problems:
            raise PartError(problems[0])
        frames, groups = self.vision_tower.layout.temporal_patch_size, self.SETTINGS.PROMPT_LAYOUT.video_frame_groups
        if frames != groups:
            raise PartError(f"model.vision_tower.vision_config.temporal_patch_size: {frames}; Qwen3-VL's prompt "
                            f"times each video frame group as {groups} frames; valid: {groups}")
