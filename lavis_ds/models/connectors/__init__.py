"""Connectors, registered by name (``registry.connectors``): ``qformer``, ``instruct_qformer``, ``mlp2x_gelu``,
``linear``, ``patch_merger``, ``qwen3_vl_merger``."""
from lavis_ds.models.connectors import mlp, patch_merger, qformer, qwen3_merger
from lavis_ds.models.connectors.base import Connector

__all__ = ["Connector", "mlp", "patch_merger", "qformer", "qwen3_merger"]
