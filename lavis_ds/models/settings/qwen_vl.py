"""The config side of the Qwen-VL architectures (``models.qwen_vl``, ``models.qwen3_vl``, ``models.qwen3_5``): flat
parts of images of their own sizes, the prompt's vision span and video placeholder, Qwen-VL's image processor."""
from __future__ import annotations

from lavis_ds.models.prompt import PromptLayout
from lavis_ds.models.settings.composed import ComposedSettings

VISION_SPAN = ("<|vision_start|>", "<|vision_end|>")  # Qwen2-VL's chat template around each image's placeholders
VIDEO_TOKEN = "<|video_pad|>"


class QwenVLSettings(ComposedSettings):
    """What the Qwen-VL architectures' sections share; the subclasses name their default parts."""

    FLAT_FEATURES = True
    # The vision span around each image; the published tokenizer's special tokens (a transformers processor needs
    # all); a video's placeholders, as Qwen2-VL's processor and chat template write them.
    PROMPT_LAYOUT = PromptLayout(image_span=VISION_SPAN, prompt_tokens=(*VISION_SPAN, VIDEO_TOKEN),
                                 video_token=VIDEO_TOKEN)
    # Qwen-VL trains without augmentation: training and evaluation images are processed alike.
    IMAGE_PROCESSORS = {"train": "qwen_vl_image", "eval": "qwen_vl_image"}


class Qwen2VLSettings(QwenVLSettings):
    """Qwen2-VL's parts: the ``qwen2_vl`` tower, ``patch_merger`` with LayerNorm."""

    DEFAULT_PARTS = {"vision_tower": {"name": "qwen2_vl"}, "connector": {"name": "patch_merger", "norm": "layernorm"}}


class Qwen25VLSettings(QwenVLSettings):
    """Qwen2.5-VL's parts: the ``qwen2_5_vl`` tower (windowed attention), ``patch_merger`` with RMSNorm."""

    DEFAULT_PARTS = {"vision_tower": {"name": "qwen2_5_vl"}, "connector": {"name": "patch_merger", "norm": "rmsnorm"}}
