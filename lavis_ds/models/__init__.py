"""Registered models, vision towers and connectors. Importing this package registers every one below by name."""
from lavis_ds.models import blip2_qwen, connectors, eva_vit, towers
from lavis_ds.models.base import BaseModel
from lavis_ds.models.blip2_qwen import Blip2Qwen
from lavis_ds.models.eva_vit import EvaViT

__all__ = ["BaseModel", "Blip2Qwen", "EvaViT", "blip2_qwen", "connectors", "eva_vit", "towers"]
