"""BLIP-2 image processors: PIL image in, normalised FloatTensor [3, H, W] out."""
from __future__ import annotations

import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms import InterpolationMode

from lavis_ds.common import registry as reg
from lavis_ds.processors.base import BaseProcessor

# CLIP's statistics: EVA-CLIP (BLIP-2's ViT) was trained with them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _normalize(mean: list[float] | None, std: list[float] | None) -> transforms.Normalize:
    mean = list(CLIP_MEAN if mean is None else mean)
    std = list(CLIP_STD if std is None else std)
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"mean and std need one value per RGB channel, got mean={mean}, std={std}")
    if any(s <= 0 for s in std):
        raise ValueError(f"std values must be positive, got {std}")
    return transforms.Normalize(mean, std)


def _check_image_size(image_size: int) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")


def _to_rgb(image: Image.Image) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise TypeError(f"image processors take a PIL image, got {type(image).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


class _Blip2ImageProcessor(BaseProcessor):
    """Shared call path; subclasses set ``self.transform``."""

    transform: transforms.Compose

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.transform(_to_rgb(image))


@reg.processors.register("blip2_image_train")
class Blip2ImageTrainProcessor(_Blip2ImageProcessor):
    """Random resized crop (bicubic) + horizontal flip + CLIP normalisation."""

    def __init__(
        self,
        *,
        image_size: int = 224,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        min_scale: float = 0.5,
        max_scale: float = 1.0,
    ) -> None:
        _check_image_size(image_size)
        if not 0 < min_scale <= max_scale <= 1:
            raise ValueError(f"need 0 < min_scale <= max_scale <= 1, got min_scale={min_scale}, max_scale={max_scale}")
        self.image_size, self.min_scale, self.max_scale = image_size, min_scale, max_scale
        self.mean, self.std = mean, std
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(
                image_size, scale=(min_scale, max_scale), interpolation=InterpolationMode.BICUBIC
            ),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            _normalize(mean, std),
        ])


@reg.processors.register("blip2_image_eval")
class Blip2ImageEvalProcessor(_Blip2ImageProcessor):
    """Deterministic square resize (bicubic) + CLIP normalisation."""

    def __init__(
        self,
        *,
        image_size: int = 224,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ) -> None:
        _check_image_size(image_size)
        self.image_size, self.mean, self.std = image_size, mean, std
        self.transform = transforms.Compose([
            transforms.Resize((image_size, image_size), interpolation=InterpolationMode.BICUBIC),
            transforms.ToTensor(),
            _normalize(mean, std),
        ])
