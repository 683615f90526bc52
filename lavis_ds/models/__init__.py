"""Registered models, vision towers, connectors and Hugging Face families. Importing this package registers every
one below by name."""
from lavis_ds.models import (blip2_qwen, connectors, eva_vit, hf, instructblip, llava, qwen3_5, qwen3_vl, qwen_vl,
                             towers)
from lavis_ds.models.base import BaseModel
from lavis_ds.models.blip2_qwen import Blip2Qwen
from lavis_ds.models.eva_vit import EvaViT
from lavis_ds.models.instructblip import InstructBlip
from lavis_ds.models.llava import Llava
from lavis_ds.models.qwen3_5 import Qwen35
from lavis_ds.models.qwen3_vl import Qwen3VL
from lavis_ds.models.qwen_vl import Qwen2VL, Qwen25VL

__all__ = ["BaseModel", "Blip2Qwen", "EvaViT", "InstructBlip", "Llava", "blip2_qwen", "connectors", "eva_vit", "hf",
           "instructblip", "llava", "Qwen2VL", "Qwen25VL", "Qwen35", "Qwen3VL", "qwen3_5", "qwen3_vl", "qwen_vl",
           "towers"]
