"""Datasets and their builders (importing this registers the builders)."""
from lavis_ds.datasets.builders import (
    BaseDatasetBuilder,
    CocoCaptionBuilder,
    InstructionBuilder,
    LlavaConversationBuilder,
)
from lavis_ds.datasets.demo_builder import DemoShapesBuilder
from lavis_ds.datasets.demo_pairs import DemoShapePairsBuilder
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes, generate_demo_shapes
from lavis_ds.datasets.instruction import IMAGE_PLACEHOLDER, InstructionDataset, InstructionRecord, UnreadableImageError
from lavis_ds.datasets.video import UnreadableVideoError
from lavis_ds.datasets.loading import BadRecordsError, RecordLoader
from lavis_ds.datasets.mixing import MixedDataset, mix_train_splits
from lavis_ds.datasets.options import CocoCaptionOptions, LlavaOptions, SectionOptions
from lavis_ds.datasets.processor_sections import build_processor
from lavis_ds.datasets.records import BadRecord
from lavis_ds.datasets.vqa import VqaBuilder, VqaOptions, parse_vqa_file

__all__ = [
    "BaseDatasetBuilder",
    "InstructionBuilder",
    "LlavaConversationBuilder",
    "CocoCaptionBuilder",
    "DemoShapesBuilder",
    "VqaBuilder",
    "VqaOptions",
    "parse_vqa_file",
    "SectionOptions",
    "LlavaOptions",
    "CocoCaptionOptions",
    "build_processor",
    "InstructionDataset",
    "InstructionRecord",
    "IMAGE_PLACEHOLDER",
    "BadRecord",
    "BadRecordsError",
    "RecordLoader",
    "UnreadableImageError",
    "UnreadableVideoError",
    "MixedDataset",
    "mix_train_splits",
    "DemoShapesSpec",
    "ensure_demo_shapes",
    "generate_demo_shapes",
]
