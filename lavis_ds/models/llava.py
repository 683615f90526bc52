"""LLaVA: a CLIP (or SigLIP) tower's patch features, one LLM token each through ``mlp2x_gelu``, in a chat LLM.

LLaVA-1.5 is CLIP ViT-L/14-336 (penultimate layer, CLS dropped, images padded to a square with the mean
colour) + ``mlp2x_gelu`` + Vicuna-7B; transformers' ``LlavaForConditionalGeneration`` holds the same parts
(``vision_tower``, ``multi_modal_projector``, ``language_model``). Published weights it reads: such a
folder, or LLaVA's stage-1 ``mm_projector.bin`` (``lavis_ds.models.published``; the transformers class's
family record: ``lavis_ds.models.hf.llava``).
"""
from __future__ import annotations

from lavis_ds.common import registry as reg
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.models.settings.composed import ComposedSettings


@reg.models.register("llava")
class Llava(VisionLLM):
    """A vision tower (CLIP by default) and a projector (``mlp2x_gelu`` by default) into any chat LLM."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "llava1.5_7b": "models/llava/llava1.5_7b.yaml",
        "siglip_qwen2.5_7b": "models/llava/siglip_qwen2.5_7b.yaml",
        "tiny": "models/llava/tiny.yaml",
    }
    SETTINGS = ComposedSettings  # CLIP and mlp2x_gelu where the section names no part

