"""Connectors, registered by name (``registry.connectors``): ``qformer``, ``instruct_qformer``, ``mlp2x_gelu``,
``linear``."""
from lavis_ds.models.connectors import mlp, qformer
from lavis_ds.models.connectors.base import Connector

__all__ = ["Connector", "mlp", "qformer"]
