"""Registered models. Importing this package registers every model below by name."""
from lavis_ds.models import blip2_qwen, eva_vit
from lavis_ds.models.base import BaseModel
from lavis_ds.models.blip2_qwen import Blip2Qwen
from lavis_ds.models.eva_vit import EvaViT

__all__ = ["BaseModel", "Blip2Qwen", "EvaViT", "blip2_qwen", "eva_vit"]
