"""Vision towers, registered by name (``registry.vision_towers``): ``eva_vit_g``, ``clip``, ``siglip``."""
from lavis_ds.models.towers import eva, hf_vision
from lavis_ds.models.towers.base import ImageProcessing, VisionTower

__all__ = ["ImageProcessing", "VisionTower", "eva", "hf_vision"]
