"""Datasets and their builders (importing this registers the builders)."""
from lavis_ds.datasets.builders import BaseDatasetBuilder, DemoShapesBuilder, InstructionBuilder, build_processor
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes, generate_demo_shapes
from lavis_ds.datasets.instruction import IMAGE_PLACEHOLDER, InstructionDataset, InstructionRecord

__all__ = [
    "BaseDatasetBuilder",
    "InstructionBuilder",
    "DemoShapesBuilder",
    "build_processor",
    "InstructionDataset",
    "InstructionRecord",
    "IMAGE_PLACEHOLDER",
    "DemoShapesSpec",
    "ensure_demo_shapes",
    "generate_demo_shapes",
]
