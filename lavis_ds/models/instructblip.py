"""InstructBLIP (LAVIS's ``blip2_vicuna_instruct``): EVA-ViT-g, an instruction-aware Q-Former, any chat LLM.

The instruction's BERT tokens enter the Q-Former beside its 32 queries (``instruct_qformer``); only the query
outputs, projected, reach the LLM. transformers' ``InstructBlipForConditionalGeneration`` holds the same parts
(``vision_model``, ``qformer`` + ``query_tokens``, ``language_projection``, ``language_model``). Published
weights it reads: such a folder, or LAVIS's InstructBLIP ``.pth`` (``lavis_ds.models.published``; the transformers class's
family record: ``lavis_ds.models.hf.blip``).
"""
from __future__ import annotations

from lavis_ds.common import registry as reg
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.models.settings.composed import InstructBlipSettings


@reg.models.register("instructblip")
class InstructBlip(VisionLLM):
    """EVA-ViT-g and InstructBLIP's Q-Former (instruction beside the queries) into any chat LLM."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "vicuna7b": "models/instructblip/vicuna7b.yaml",
        "tiny": "models/instructblip/tiny.yaml",
    }
    SETTINGS = InstructBlipSettings

