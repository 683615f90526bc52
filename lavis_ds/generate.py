"""Answer a prompt about images with an exported model, without DeepSpeed.

    python -m lavis_ds.generate --model exports/demo --image a.png --prompt "Describe the image in a few words."
    python -m lavis_ds.generate --model exports/demo --image a.png b.png --prompt "..." --json

Images go through the eval image processor of the export's first dataset section
(``blip2_image_eval`` at the model's ``image_size`` if there is none), the prompt
through its eval text processor, as in the run's evaluation. A prompt without
``<ImageHere>`` gets the image in front (``<Img><ImageHere></Img> prompt``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image
from torch import nn

from lavis_ds.export import ExportError, load_exported, read_export_config


def eval_processors(folder: str | Path) -> tuple[Callable, Callable | None]:
    """``(image processor, text processor or None)`` for an export folder."""
    from lavis_ds.datasets.builders import build_processor

    cfg = read_export_config(folder)
    for section in (cfg.get("datasets") or {}).values():
        if "vis_processor" in section:
            text = section.get("text_processor")
            return build_processor(section.vis_processor.eval), build_processor(text.eval) if text else None
    return build_processor({"name": "blip2_image_eval", "image_size": int(cfg.model.image_size)}), None


def cast_dtype(model: nn.Module) -> torch.dtype | None:
    """The half dtype all parameters of a model were cast to (what a bf16/fp16 DeepSpeed engine does), else None."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return next(iter(dtypes)) if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16} else None


def as_trained(model: nn.Module, batch: dict[str, Any]) -> tuple[dict[str, Any], contextlib.AbstractContextManager]:
    """``(batch, context)`` to run ``model`` on ``batch`` as DeepSpeedRunner ran it in training.

    A model whose parameters are all bf16 (or fp16) gets float inputs in that dtype and
    runs under autocast (as the runner feeds its engine); any other model gets the batch
    on its device and no autocast.
    """
    half = cast_dtype(model)
    device = next(model.parameters()).device
    batch = {k: (v.to(device, half if half and v.is_floating_point() else None) if torch.is_tensor(v) else v)
             for k, v in batch.items()}
    return batch, torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None)


@torch.no_grad()
def generate(model: nn.Module, images: torch.Tensor, prompts: list[str], **generate_kwargs: Any) -> list[str]:
    """Answers for a batch: ``images [B, 3, H, W]`` (processed) and one prompt per image.

    Keyword arguments go to the model's ``generate`` (``max_new_tokens``, ``num_beams``, ...).
    """
    batch, context = as_trained(model, {"image": images, "instruction": [[p] for p in prompts]})
    with context:
        return model.generate(batch, **generate_kwargs)


def main(argv: list[str] | None = None) -> int:
    from lavis_ds.datasets.instruction import process_text

    parser = argparse.ArgumentParser(prog="python -m lavis_ds.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="export folder (python export.py ... --out <folder>)")
    parser.add_argument("--image", required=True, nargs="+", help="image file(s); one batch")
    parser.add_argument("--prompt", required=True, help="the question or instruction")
    parser.add_argument("--max-new-tokens", type=int, default=30)
    parser.add_argument("--min-new-tokens", type=int, default=None)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="auto (the dtype it trained in), fp32, bf16 or fp16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON list of {image, generated}")
    args = parser.parse_args(argv)

    missing = [path for path in args.image if not Path(path).is_file()]
    if missing:
        print(f"lavis_ds generate: image file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        model = load_exported(args.model, device=args.device, dtype=args.dtype)
        image_processor, text_processor = eval_processors(args.model)
    except ExportError as e:
        print(f"lavis_ds generate: {e}", file=sys.stderr)
        return 2
    images = []
    for path in args.image:
        with Image.open(path) as image:
            images.append(image_processor(image.convert("RGB")))
    prompt = process_text(args.prompt, text_processor) if text_processor else args.prompt
    kwargs = {"max_new_tokens": args.max_new_tokens, "num_beams": args.num_beams}
    if args.min_new_tokens is not None:
        kwargs["min_new_tokens"] = args.min_new_tokens
    texts = generate(model, torch.stack(images), [prompt] * len(images), **kwargs)
    if args.json:
        print(json.dumps([{"image": path, "generated": text} for path, text in zip(args.image, texts)]))
    else:
        for path, text in zip(args.image, texts):
            print(text if len(args.image) == 1 else f"{path}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
