"""Image and text processors, registered by name (import order = registration)."""
from lavis_ds.processors.base import BaseProcessor
from lavis_ds.processors.image import (CLIP_MEAN, CLIP_STD, Blip2ImageEvalProcessor, Blip2ImageTrainProcessor,
                                       ImageProcessing, TowerImageEvalProcessor, TowerImageTrainProcessor)
from lavis_ds.processors.qwen_vl import QwenVLImageProcessor, QwenVLProcessing
from lavis_ds.processors.text import BaseInstructionProcessor, BlipCaptionProcessor, PlainTextProcessor

__all__ = [
    "BaseProcessor",
    "Blip2ImageTrainProcessor",
    "Blip2ImageEvalProcessor",
    "TowerImageTrainProcessor",
    "TowerImageEvalProcessor",
    "ImageProcessing",
    "BlipCaptionProcessor",
    "BaseInstructionProcessor",
    "PlainTextProcessor",
    "QwenVLImageProcessor",
    "QwenVLProcessing",
    "CLIP_MEAN",
    "CLIP_STD",
]
