"""Image processors: PIL image in, normalised FloatTensor [3, H, W] out.

Two families, registered by name:

- ``blip2_image_train`` / ``blip2_image_eval``: LAVIS's BLIP-2 processors (a random resized crop and flip for
  training, a square resize for evaluation, CLIP's mean and std unless given). MiniGPT4Qwen's YAMLs name them.
- ``tower_image_train`` / ``tower_image_eval``: the vision tower's own processing (:class:`ImageProcessing`: the
  size, mean/std, resize and padding its weights were trained with). The config loader fills their keys from
  ``model.vision_tower`` (``lavis_ds.image_config``), so a run trains on, evaluates on and exports exactly the
  processing its tower describes. The default of ``llava`` and ``instructblip`` models.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Mapping

import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms import InterpolationMode

from lavis_ds.common import registry as reg
from lavis_ds.processors.base import BaseProcessor

# CLIP's statistics: EVA-CLIP (BLIP-2's ViT) and OpenAI's CLIP were trained with them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESIZES = ("squash", "shortest_edge")


@dataclass(frozen=True)
class ImageProcessing:
    """How a tower's images are prepared: the tower's counterpart of timm's ``pretrained_cfg``.

    Attributes:
        size: Square side the tower takes.
        mean: Per-channel mean the weights were trained with (RGB, 0..1).
        std: Per-channel std.
        resize: ``squash`` resizes to ``size x size`` (BLIP-2, SigLIP); ``shortest_edge`` resizes the
            shorter side to ``size`` and center-crops (CLIP's processor).
        pad_to_square: Pad the image to a square with the mean colour first (LLaVA-1.5's ``pad`` aspect
            ratio, its ``expand2square``): the whole image is seen, undistorted, nothing cropped.
    """

    size: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    resize: Literal["squash", "shortest_edge"] = "squash"
    pad_to_square: bool = False

    @property
    def pad_colour(self) -> tuple[int, int, int]:
        """The mean colour in 0..255, as LLaVA computes it: ``tuple(int(x * 255) for x in image_mean)``."""
        return tuple(int(x * 255) for x in self.mean)  # type: ignore[return-value]

    def processor_keys(self) -> dict[str, Any]:
        """The keys of a ``tower_image_*`` section that do this processing."""
        return {"image_size": self.size, "mean": list(self.mean), "std": list(self.std), "resize": self.resize,
                "pad_to_square": self.pad_to_square}

    def transform(self, crop_scale: tuple[float, float] | None = None, hflip: bool = False
                  ) -> Callable[[Image.Image], torch.Tensor]:
        """PIL image -> normalised ``[3, size, size]`` float tensor (bicubic resampling, as all three families).

        ``crop_scale``: a random resized crop of that area fraction (after the padding) instead of the resize;
        ``hflip``: a random horizontal flip. Neither is part of a tower's processing: training augmentation."""
        bicubic = InterpolationMode.BICUBIC
        steps: list[Any] = [_to_rgb]
        if self.pad_to_square:
            steps.append(functools.partial(expand_to_square, colour=self.pad_colour))  # picklable: spawn workers
        if crop_scale is not None:
            steps.append(transforms.RandomResizedCrop(self.size, scale=crop_scale, interpolation=bicubic))
        elif self.resize == "squash":
            steps.append(transforms.Resize((self.size, self.size), interpolation=bicubic))
        else:
            steps += [transforms.Resize(self.size, interpolation=bicubic), transforms.CenterCrop(self.size)]
        if hflip:
            steps.append(transforms.RandomHorizontalFlip())
        steps += [transforms.ToTensor(), transforms.Normalize(self.mean, self.std)]
        return transforms.Compose(steps)


def expand_to_square(image: Image.Image, colour: tuple[int, int, int]) -> Image.Image:
    """``image`` centred on a square canvas of ``colour`` (LLaVA's ``expand2square``)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), colour)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


def _stats(mean: list[float] | None, std: list[float] | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    mean = tuple(CLIP_MEAN if mean is None else mean)
    std = tuple(CLIP_STD if std is None else std)
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"mean and std need one value per RGB channel, got mean={list(mean)}, std={list(std)}")
    if any(s <= 0 for s in std):
        raise ValueError(f"std values must be positive, got {list(std)}")
    return mean, std


def _check_image_size(image_size: int) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")


def _check_scales(min_scale: float, max_scale: float) -> None:
    if not 0 < min_scale <= max_scale <= 1:
        raise ValueError(f"need 0 < min_scale <= max_scale <= 1, got min_scale={min_scale}, max_scale={max_scale}")


def _to_rgb(image: Image.Image) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise TypeError(f"image processors take a PIL image, got {type(image).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


class _ImageProcessor(BaseProcessor):
    """Shared call path; subclasses set ``self.transform`` and ``self.processing`` (the deterministic processing
    whose size, statistics and padding the processor's output has: what the config check compares with the tower's
    and what a Hugging Face export's image processor does)."""

    transform: Callable[[Image.Image], torch.Tensor]
    processing: ImageProcessing
    augments = False  # random crops or flips on top of ``processing``: not what an export can serve

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.transform(_to_rgb(image))


@reg.processors.register("blip2_image_train")
class Blip2ImageTrainProcessor(_ImageProcessor):
    """Random resized crop (bicubic) + horizontal flip + CLIP normalisation."""

    augments = True

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
        _check_scales(min_scale, max_scale)
        self.image_size, self.min_scale, self.max_scale = image_size, min_scale, max_scale
        self.mean, self.std = mean, std
        self.processing = ImageProcessing(image_size, *_stats(mean, std))
        self.transform = self.processing.transform(crop_scale=(min_scale, max_scale), hflip=True)


@reg.processors.register("blip2_image_eval")
class Blip2ImageEvalProcessor(_ImageProcessor):
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
        self.processing = ImageProcessing(image_size, *_stats(mean, std))
        self.transform = self.processing.transform()


class TowerImageProcessor(_ImageProcessor):
    """A vision tower's :class:`ImageProcessing` as a processor; its keys come from ``model.vision_tower`` when the
    run config is loaded (``lavis_ds.image_config.fill_tower_processing``)."""

    # The config loader fills the keys of these sections that are left out from the model's vision tower.
    FROM_TOWER: ClassVar[bool] = True
    TOWER_KEYS: ClassVar[tuple[str, ...]] = ("image_size", "mean", "std", "resize", "pad_to_square")
    NAME: ClassVar[str]  # the registered name, for messages

    def __init__(self, *, image_size: int | None = None, mean: list[float] | None = None,
                 std: list[float] | None = None, resize: Literal["squash", "shortest_edge"] | None = None,
                 pad_to_square: bool | None = None) -> None:
        """
        Args:
            image_size: The tower's side.
            mean: Per-channel mean its weights were trained with.
            std: Per-channel std.
            resize: ``squash`` (square resize) or ``shortest_edge`` (shorter side to ``image_size``, centre crop).
            pad_to_square: Pad to a square with the mean colour first (LLaVA-1.5).

        Left out, each is the tower's (filled in by the config loader); a processor built without them is refused.
        """
        given = dict(image_size=image_size, mean=mean, std=std, resize=resize, pad_to_square=pad_to_square)
        missing = [key for key, value in given.items() if value is None]
        if missing:
            raise ValueError(f"{self.NAME}: {', '.join(missing)} not set; they come from the model's vision tower "
                             "when the run config is loaded (lavis_ds.config.load_config), or pass them (e.g. "
                             "ImageProcessing(...).processor_keys())")
        _check_image_size(image_size)
        if resize not in RESIZES:
            raise ValueError(f"resize must be one of {', '.join(RESIZES)}, got {resize!r}")
        self.image_size, self.mean, self.std, self.resize, self.pad_to_square = (image_size, mean, std, resize,
                                                                                 pad_to_square)
        self.processing = ImageProcessing(image_size, *_stats(mean, std), resize, bool(pad_to_square))


@reg.processors.register("tower_image_eval")
class TowerImageEvalProcessor(TowerImageProcessor):
    """The tower's processing exactly: what its Hugging Face export's image processor does."""

    NAME = "tower_image_eval"

    def __init__(self, **tower_keys: Any) -> None:
        super().__init__(**tower_keys)
        self.transform = self.processing.transform()


@reg.processors.register("tower_image_train")
class TowerImageTrainProcessor(TowerImageProcessor):
    """The tower's processing, by default without augmentation: LLaVA trains on exactly what it serves (its
    ``expand2square`` and the CLIP processor, no random crop, no flip). ``min_scale`` and ``hflip`` add LAVIS's
    augmentation (InstructBLIP: ``min_scale: 0.5``, ``hflip: true``)."""

    NAME = "tower_image_train"

    def __init__(self, *, min_scale: float | None = None, max_scale: float = 1.0, hflip: bool = False,
                 **tower_keys: Any) -> None:
        """
        Args:
            min_scale: A random resized crop of ``min_scale``..``max_scale`` of the (padded) image's area instead
                of the tower's resize; None: no crop.
            max_scale: The crop's largest area fraction.
            hflip: Flip half the images left to right (wrong for data that speaks of left and right).
            **tower_keys: ``image_size``, ``mean``, ``std``, ``resize``, ``pad_to_square`` (the tower's).
        """
        super().__init__(**tower_keys)
        if min_scale is not None:
            _check_scales(min_scale, max_scale)
        self.min_scale, self.max_scale, self.hflip = min_scale, max_scale, hflip
        self.augments = min_scale is not None or hflip
        crop = None if min_scale is None else (min_scale, max_scale)
        self.transform = self.processing.transform(crop_scale=crop, hflip=hflip)


def awaits_tower(section: Any) -> bool:
    """Whether ``section`` names a ``tower_image_*`` processor whose tower keys are not all there yet (the config
    loader fills them from the model's tower: ``lavis_ds.image_config``)."""
    known = isinstance(section, Mapping) and section.get("name") in reg.processors
    cls = reg.processors.get(section["name"]) if known else None
    return isinstance(cls, type) and issubclass(cls, TowerImageProcessor) and \
        any(section.get(key) is None for key in cls.TOWER_KEYS)
