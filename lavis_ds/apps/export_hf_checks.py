"""Which transformers class a lavis_ds model exports to, and what of the model that class cannot express.

The classes are the registered Hugging Face families (``registry.hf_families``, ``lavis_ds.models.hf``): each says
which models its class holds and what of such a model it cannot express, read from the built modules, not the
config, so that a variant added later is judged by what it computes. A model no family holds is refused at once
(:func:`hf_family`), with the pairs that export; for the others every problem is collected and reported at once,
with what every family shares: the eval image processing the export reproduces and the ChatML prompt.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from lavis_ds.apps.export_io import ExportError
from lavis_ds.models.hf.family import HfFamily, all_families, exporting_family, part_name

# The image processor LAVIS's BLIP-2 configs (and blip2_qwen's presets) evaluate with; BlipImageProcessor does the
# same steps.
EVAL_IMAGE_PROCESSOR = "blip2_image_eval"
INSTEAD = ("export it with --format lavis_ds (the default): a folder of its trained weights and config that "
           "lavis_ds loads (load_exported, `python -m lavis_ds.apps.generate`, chat, the web page)")


def exportable() -> str:
    """What --format hf writes: each family's class and the models it holds."""
    return "; ".join(family.exports() for family in all_families())


def hf_family(model: nn.Module) -> HfFamily:
    """The family whose transformers class ``model`` exports to; ExportError if none holds it."""
    from lavis_ds.common.registry import connectors, vision_towers

    family = exporting_family(model)
    if family is not None:
        return family
    if not hasattr(model, "vision_tower"):
        raise ExportError(f"--format hf: {type(model).__name__} is not a vision_tower + connector architecture; "
                          f"{INSTEAD}")
    tower, connector = part_name(model.vision_tower, vision_towers), part_name(model.connector, connectors)
    whys = [f.why_not[connector] for f in all_families() if connector in f.why_not]
    why = whys[0] if whys else "no transformers class holds this tower with this connector"
    raise ExportError(f"--format hf: cannot export vision tower {tower!r} + connector {connector!r}: {why}. "
                      f"What --format hf writes: {exportable()}. For this model, {INSTEAD}")


def check_expressible(model: nn.Module, image_cfg: dict[str, Any] | None = None) -> HfFamily:
    """The family of ``model`` (:func:`hf_family`); one ExportError listing everything its class cannot hold."""
    family = hf_family(model)
    problems = (family.weights.export_problems(model)
                + _image_processor_problems(image_cfg, family.processors.square_images_only)
                + _prompt_problems(model))
    if problems:
        raise ExportError(f"cannot export as transformers' {family.hf_class}, which cannot express:\n  - "
                          + "\n  - ".join(problems))
    return family


def _image_processor_problems(image_cfg: dict[str, Any] | None, square_only: bool) -> list[str]:
    """The eval image processor lavis_ds generates with must be one the export's image processor reproduces."""
    from lavis_ds.apps.export_hf_processor import image_processing_of

    if image_cfg is None:  # the model's own processing (export_hf_processor.default_image_cfg), checked when written
        return []
    processing = image_processing_of(image_cfg)
    if processing is None:
        return [f"the eval image processor {image_cfg.get('name')!r}; the export's image processors reproduce "
                f"{EVAL_IMAGE_PROCESSOR} (square bicubic resize, normalise), tower_image_eval (the tower's "
                "processing) and other processors that carry an ImageProcessing only"]
    if square_only and (processing.resize != "squash" or processing.pad_to_square):
        return [f"the eval image processing {processing}; BlipImageProcessor reproduces a square resize without "
                "padding only"]
    return []


def _prompt_problems(model: nn.Module) -> list[str]:
    """The export writes lavis_ds's ChatML prompt as the folder's chat template (export_hf_processor): a model
    whose prompt is another family's chat template (Llama 3, Gemma, ...) would be prompted otherwise there."""
    prompt = getattr(getattr(model, "llm", None), "prompt", None)
    if prompt is None:
        return []
    im_end = prompt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if prompt.end_of_turn_id == im_end:
        return []
    name = prompt.tokenizer.convert_ids_to_tokens(prompt.end_of_turn_id)
    return [f"the prompt: the LLM's chat template ends its turns with {name!r}, not ChatML's <|im_end|>, and the HF "
            "export's chat template writes ChatML only; export with --format lavis_ds"]
