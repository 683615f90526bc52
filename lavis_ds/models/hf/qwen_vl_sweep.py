"""The export-time placeholder sweep of a Qwen-VL ``--format hf`` export: the exported processor must reserve, for
an image of any size, the placeholders training reserved for it.

Training counts an image's tokens with ``qwen_vl_image``'s ``tokens_for_image`` of the grid its processing gives the
image; transformers' processor expands each ``<|image_pad|>`` into ``image_grid_thw.prod() // merge_size**2`` copies of
its own. The two agree only while the exported image processor resizes as training did (its ``min_pixels`` /
``max_pixels``, patch and merge sizes), which a setting written under another name, or a transformers release that
reads it otherwise, silently breaks: every prompt then has more or fewer slots than the model has features ("image
features and image tokens do not match"). So the export runs both on images of a sweep of sizes and aspect ratios
(small, large, 1:4, 4:1, sides that are not multiples of 28 px) and refuses at the first size where they differ.
"""
from __future__ import annotations

from typing import Any

from PIL import Image

from lavis_ds.models.export_folder import ExportError
from lavis_ds.processors.qwen_vl import QwenVLImageProcessor, QwenVLProcessing

# (width, height) px of the images the sweep prompts with.
SWEEP_SIZES: tuple[tuple[int, int], ...] = (
    (10, 10),  # below one 28 px merge window: scaled up to min_pixels
    (56, 56),  # min_pixels' default side
    (100, 37), (37, 100),  # sides that are not multiples of 28 px
    (448, 112), (112, 448),  # wide 4:1 and tall 1:4
    (517, 333),  # an odd size of a photo's aspect
    (1920, 1080), (1000, 4000), (4000, 1000),  # large: over the default max_pixels, scaled down
)


def sweep_difference(processor: Any, processing: QwenVLProcessing) -> tuple[tuple[int, int], int, int] | None:
    """The first sweep size ``(width, height)`` at which ``processor`` (transformers' Qwen2-VL / Qwen2.5-VL processor)
    reserves another number of ``<|image_pad|>`` tokens than training does with ``processing``, with the two counts
    ``(size, exported, trained)``; None where every size agrees."""
    trained = QwenVLImageProcessor(**processing.processor_keys())
    run = "<|vision_start|>" + processor.image_token + "<|vision_end|>"
    for width, height in SWEEP_SIZES:
        image = Image.new("RGB", (width, height))
        reserved = trained.tokens_for_image(trained(image).grid_thw)
        ids = processor(text=[run], images=[image], return_tensors="pt")["input_ids"]
        exported = int((ids == processor.image_token_id).sum())
        if exported != reserved:
            return (width, height), exported, reserved
    return None


def check_placeholder_sweep(processor: Any, processing: QwenVLProcessing, where: str) -> None:
    """ExportError naming the first sweep size at which the exported ``processor`` (read back from ``where``) and
    training's ``processing`` reserve different placeholder counts."""
    differs = sweep_difference(processor, processing)
    if differs is None:
        return
    (width, height), exported, reserved = differs
    raise ExportError(
        f"--format hf: the exported {type(processor).__name__} in {where} reserves {exported} <|image_pad|> tokens "
        f"for an image of {width}x{height} px (width x height), training reserved {reserved} (qwen_vl_image's "
        f"tokens_for_image with min_pixels {processing.min_pixels}, max_pixels {processing.max_pixels}, patch_size "
        f"{processing.patch_size}, merge_size {processing.merge_size}); its preprocessor settings must be training's: "
        "export again with the run's own eval image processor (datasets.<name>.vis_processor.eval)")
