"""Vision towers, registered by name (``registry.vision_towers``): ``eva_vit_g``, ``clip``, ``siglip``, ``qwen2_vl``,
``qwen2_5_vl``, ``qwen3_vl``."""
from lavis_ds.models.towers import eva, hf_vision, qwen3_vl, qwen_vl
from lavis_ds.models.towers.base import ImageProcessing, VisionTower

__all__ = ["ImageProcessing", "VisionTower", "eva", "hf_vision", "qwen3_vl", "qwen_vl"]
