"""Qwen2-VL / Qwen2.5-VL image and video processing: images at (nearly) their own size, as flat patches.

A Qwen-VL tower takes each image at a size of its own: ``smart_resize`` picks the multiple of 28 px (patch 14 x
merge 2) nearest the image's size whose area lies within ``min_pixels`` .. ``max_pixels``, keeping the aspect ratio.
The image is cut into 14 px patches of two frames each (a still image is two identical frames; the tower's
Conv3d patch embedding spans ``temporal_patch_size`` = 2 frames), flattened to ``pixel_values [t*h*w, 3*2*14*14]``
with every 2x2 merge window's four patches contiguous, and described by ``grid_thw`` = (t, h, w) in patches.
An image of ``t*h*w`` patches becomes ``t*h*w // merge**2`` LLM tokens (``tokens_for_grid``): the prompt and the
model count them with that one function.

Everything here reproduces transformers' ``Qwen2VLImageProcessor`` and ``Qwen2VLVideoProcessor`` (torchvision
backend: a bicubic, antialiased resize of the uint8 image, CLIP's mean/std): the same pixel values and grids.
A video's frames are sampled by ``fps`` or ``nframes`` as the video processor's ``sample_frames`` does; its
``second_per_grid_t`` (seconds per temporal patch) gives Qwen2.5-VL's absolute-time positions. A tower with
``video_*`` settings (Qwen3-VL's) samples and sizes videos as ``Qwen3VLVideoProcessor`` does instead: 2 frames a
second, one pixel budget for a video's frames together (``processors.qwen_vl_video``).

The registered processor ``qwen_vl_image`` does this processing for a dataset; the config loader fills its keys
from the model's Qwen-VL tower (``lavis_ds.image_config``), as it fills the ``tower_image_*`` processors'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Sequence

import numpy as np
import torch
from PIL import Image

from lavis_ds.common import registry as reg
from lavis_ds.processors.base import BaseProcessor
from lavis_ds.processors.image import CLIP_MEAN, CLIP_STD
from lavis_ds.processors.qwen_vl_video import QwenVisionInputError, fit_area, frames_at_rate, video_smart_resize

# The batch fields of Qwen-VL visuals beside their flat patches (``image``): one (t, h, w) row per image or video, and
# the seconds of video per temporal patch (None for a still image; Qwen2.5-VL's absolute-time positions).
GRID_KEY = "image_grid_thw"
SECONDS_KEY = "second_per_grid_t"
# Each visual's frame times in seconds (None for a still image, or a video whose frames are timed evenly by its
# second_per_grid_t): a video's sampled frames' numbers in its file over the file's frame rate, which Qwen3-VL's
# prompt writes its frame groups' timestamps from (models.frame_groups).
FRAME_SECONDS_KEY = "video_frame_seconds"
# Qwen2-VL's published image processor: at least 4 and at most 1280 merged tokens per image.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer strips
# transformers' video processor: sampled frame counts are clamped to these before rounding to temporal patches.
MIN_FRAMES, MAX_FRAMES = 4, 768


class QwenVisual(NamedTuple):
    """One image or video as a Qwen-VL tower takes it.

    Attributes:
        pixel_values: ``[t*h*w, 3*temporal_patch_size*patch_size**2]`` float patches, 2x2 merge windows contiguous.
        grid_thw: ``[3]`` long: temporal patches, patch rows, patch columns.
        second_per_grid_t: Seconds of video per temporal patch (Qwen2.5-VL's time positions); None for an image.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    second_per_grid_t: float | None = None


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) transformers' Qwen2-VL processors resize an image to: multiples of ``factor``, nearest the
    image's own, with an area in ``min_pixels`` .. ``max_pixels`` where possible, the aspect ratio kept.

    An image smaller than one merge window (a side under ``factor`` px) is scaled up like any image below
    ``min_pixels`` (a 10 x 10 px image becomes 56 x 56), as transformers does. Raises
    :class:`QwenVisionInputError` for a strip longer than 200:1 (which transformers refuses) and for
    ``max_pixels`` below ``min_pixels``."""
    check_pixel_range(min_pixels, max_pixels, factor)
    if min(height, width) <= 0:
        raise QwenVisionInputError(f"image of {width}x{height} px (width x height) has no pixels")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise QwenVisionInputError(
            f"image of {width}x{height} px (width x height) has an aspect ratio of {ratio:.1f}, over the "
            f"{MAX_ASPECT_RATIO} Qwen-VL's smart_resize takes: crop or pad it to at most {MAX_ASPECT_RATIO}:1")
    return fit_area(height, width, factor, min_pixels, max_pixels)


def check_pixel_range(min_pixels: int, max_pixels: int, factor: int = 28, where: str = "") -> None:
    """``min_pixels`` and ``max_pixels`` must each hold one merge window (``factor``² px), in that order."""
    prefix = f"{where}: " if where else ""
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < factor * factor:
            raise QwenVisionInputError(f"{prefix}{key}: {value!r}; valid: an integer of at least {factor * factor} "
                                       f"({factor}x{factor} px, one merge window; Qwen's default {key} is "
                                       f"{MIN_PIXELS if key == 'min_pixels' else MAX_PIXELS})")
    if max_pixels < min_pixels:
        raise QwenVisionInputError(f"{prefix}max_pixels: {max_pixels} is below min_pixels {min_pixels}; valid: "
                                   f"min_pixels <= max_pixels (Qwen's defaults: {MIN_PIXELS} and {MAX_PIXELS})")


def tokens_for_grid(grid_thw: Sequence[int] | torch.Tensor, merge_size: int = 2) -> int:
    """LLM tokens of one image or video of ``grid_thw`` = (t, h, w) patches: ``t*h*w // merge_size**2``. The prompt's
    placeholder count and the model's feature count are both this function."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge_size * merge_size)


def sample_frames(total_frames: int, video_fps: float | None = None, fps: float | None = None,
                  nframes: int | None = None, temporal_patch_size: int = 2, min_frames: int = MIN_FRAMES,
                  max_frames: int = MAX_FRAMES) -> list[int]:
    """Indices of the frames to take of a video of ``total_frames`` frames at ``video_fps``, as transformers'
    ``Qwen2VLVideoProcessor.sample_frames`` picks them: ``nframes`` (rounded to whole temporal patches), or ``fps``
    frames per second (clamped to ``min_frames`` .. ``max_frames`` and the video's length, floored to whole temporal
    patches), spread evenly from the first frame; every frame when neither is given."""
    if fps is not None and nframes is not None:
        raise QwenVisionInputError(f"video sampling: give fps or nframes, not both (fps={fps}, nframes={nframes})")
    if nframes is not None:
        count = round(nframes / temporal_patch_size) * temporal_patch_size
    elif fps is not None:
        if not video_fps:
            raise QwenVisionInputError(f"video sampling at fps={fps} needs the video's own frame rate; it has none "
                                       "(give nframes instead)")
        most = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
        count = min(max(total_frames / video_fps * fps, min_frames), most, total_frames)
        count = math.floor(count / temporal_patch_size) * temporal_patch_size
    else:
        return list(range(total_frames))
    if count > total_frames:
        raise QwenVisionInputError(f"video of {total_frames} frame(s): cannot sample {count} (nframes={nframes}, "
                                   f"fps={fps}); ask for at most {total_frames}")
    if count < temporal_patch_size:
        raise QwenVisionInputError(f"video of {total_frames} frame(s) at {video_fps} fps: sampling (nframes="
                                   f"{nframes}, fps={fps}) leaves {count} frame(s), fewer than the temporal patch of "
                                   f"{temporal_patch_size}; ask for at least {temporal_patch_size}")
    return torch.arange(0, total_frames, total_frames / count).int().tolist()


def _uint8_chw(image: Image.Image | np.ndarray | torch.Tensor) -> torch.Tensor:
    """An RGB image as a ``[3, H, W]`` uint8 tensor (transformers' torchvision backend reads PIL images so)."""
    if isinstance(image, Image.Image):
        array = np.array(image if image.mode == "RGB" else image.convert("RGB"))
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()
    tensor = image if isinstance(image, torch.Tensor) else torch.tensor(np.asarray(image))
    if tensor.ndim != 3 or 3 not in (tensor.shape[0], tensor.shape[-1]) or tensor.dtype != torch.uint8:
        raise QwenVisionInputError(f"Qwen-VL processing takes PIL images or uint8 [3, H, W] / [H, W, 3] arrays; got "
                                   f"{tuple(tensor.shape)} {tensor.dtype}")
    return tensor if tensor.shape[0] == 3 else tensor.permute(2, 0, 1).contiguous()


@dataclass(frozen=True)
class QwenVLProcessing:
    """How a Qwen-VL tower's images and videos are prepared (the tower carries it, as CLIP towers carry
    :class:`~lavis_ds.processors.image.ImageProcessing`).

    Attributes:
        min_pixels: Least area an image is resized to (px).
        max_pixels: Most area an image is resized to (px); a video's frames take the same bounds, each frame alone,
            unless ``video_min_pixels`` / ``video_max_pixels`` are set.
        mean: Per-channel mean the tower was trained with (OpenAI CLIP's).
        std: Per-channel std.
        patch_size: The tower's patch side (px).
        merge_size: Patches per side of one merged LLM token.
        temporal_patch_size: Frames per patch (a still image is repeated to fill it).
        video_fps: Frames a video is sampled at per second of the file (Qwen3-VL's 2), between ``video_min_frames``
            and ``video_max_frames``; None: the dataset's ``max_frames`` frames, uniformly.
        video_min_frames: Fewest frames ``video_fps`` samples (a shorter file gives all of its frames).
        video_max_frames: Most frames ``video_fps`` samples.
        video_min_pixels: Least area of a video's frames together (Qwen3-VL's per-video budget; set with
            ``video_max_pixels``); None: each frame within ``min_pixels`` .. ``max_pixels`` as an image.
        video_max_pixels: Most area of a video's frames together.
    """

    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    video_fps: float | None = None
    video_min_frames: int = MIN_FRAMES
    video_max_frames: int = MAX_FRAMES
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None

    def __post_init__(self) -> None:
        check_pixel_range(self.min_pixels, self.max_pixels, self.factor, "Qwen-VL processing")
        if len(self.mean) != 3 or len(self.std) != 3 or any(s <= 0 for s in self.std):
            raise QwenVisionInputError(f"Qwen-VL processing: mean {list(self.mean)} and std {list(self.std)}; valid: "
                                       "three values each (RGB), std positive")
        self._check_video_settings()

    def _check_video_settings(self) -> None:
        where = "Qwen-VL processing"
        if self.video_fps is not None and (isinstance(self.video_fps, bool) or
                                           not isinstance(self.video_fps, (int, float)) or self.video_fps <= 0):
            raise QwenVisionInputError(f"{where}: video_fps: {self.video_fps!r}; valid: frames per second above 0 "
                                       "(Qwen3-VL's 2), or null for the dataset's max_frames")
        frames = (self.video_min_frames, self.video_max_frames)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in frames) or frames[0] > frames[1]:
            raise QwenVisionInputError(f"{where}: video_min_frames {frames[0]!r}, video_max_frames {frames[1]!r}; "
                                       f"valid: integers, 1 <= video_min_frames <= video_max_frames (transformers' "
                                       f"{MIN_FRAMES} and {MAX_FRAMES})")
        bounds = (self.video_min_pixels, self.video_max_pixels)
        if (bounds[0] is None) != (bounds[1] is None):
            raise QwenVisionInputError(f"{where}: video_min_pixels {bounds[0]!r}, video_max_pixels {bounds[1]!r}; "
                                       "valid: both (a video's pixel budget) or neither (each frame as an image)")
        if bounds[0] is not None:
            check_pixel_range(*bounds, self.factor, f"{where} (video_min_pixels, video_max_pixels)")

    @property
    def factor(self) -> int:
        """Side of one merge window in px: resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    def processor_keys(self) -> dict[str, Any]:
        """The keys of a ``qwen_vl_image`` section that do this processing."""
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "mean": list(self.mean),
                "std": list(self.std), "patch_size": self.patch_size, "merge_size": self.merge_size,
                "temporal_patch_size": self.temporal_patch_size, "video_fps": self.video_fps,
                "video_min_frames": self.video_min_frames, "video_max_frames": self.video_max_frames,
                "video_min_pixels": self.video_min_pixels, "video_max_pixels": self.video_max_pixels}

    def video_frame_count(self, total_frames: int, file_fps: float | None) -> int | None:
        """Frames to sample of a video of ``total_frames`` frames at ``file_fps`` (None: the file tells no rate):
        ``video_fps`` frames a second (``frames_at_rate``); None where ``video_fps`` is unset (the dataset's
        ``max_frames`` then)."""
        if self.video_fps is None:
            return None
        return frames_at_rate(total_frames, file_fps, self.video_fps, self.video_min_frames, self.video_max_frames)

    def resized_size(self, height: int, width: int, frames: int = 1) -> tuple[int, int]:
        """(height, width) an image (``frames`` = 1) of this size is resized to (``smart_resize``), or ``frames``
        video frames: within the video's pixel budget where it has one (``video_smart_resize``), else each as an
        image."""
        if frames > 1 and self.video_max_pixels is not None:
            return video_smart_resize(frames, height, width, self.temporal_patch_size, self.factor,
                                      self.video_min_pixels, self.video_max_pixels)
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
        """(t, h, w) patches of an image (``frames`` = 1) or of ``frames`` sampled video frames of this size."""
        if frames < 1:
            raise QwenVisionInputError(f"Qwen-VL grid of {frames} frame(s): an image is 1 frame, a video at least "
                                       f"{self.temporal_patch_size}")
        resized_h, resized_w = self.resized_size(height, width, frames)
        temporal = -(-frames // self.temporal_patch_size) if frames > 1 else 1
        return temporal, resized_h // self.patch_size, resized_w // self.patch_size

    def tokens_for_size(self, height: int, width: int, frames: int = 1) -> int:
        """LLM tokens of an image (or ``frames`` video frames) of ``height`` x ``width`` px as given, before
        resizing: ``tokens_for_grid`` of its grid."""
        return tokens_for_grid(self.grid(height, width, frames), self.merge_size)

    def image(self, image: Image.Image | np.ndarray | torch.Tensor) -> QwenVisual:
        """One image's patches and grid, as ``Qwen2VLImageProcessor`` makes them."""
        pixels = self._resized(_uint8_chw(image)[None])  # [1, 3, H, W]
        frames = pixels[:, None].expand(-1, self.temporal_patch_size, -1, -1, -1)  # a still image: identical frames
        patches, grid = self._patchify(frames)
        return QwenVisual(patches, grid)

    def video(self, frames: Sequence[Image.Image | np.ndarray | torch.Tensor], sampled_fps: float | None = None
              ) -> QwenVisual:
        """A video's (sampled) frames as patches of ``temporal_patch_size`` frames, as ``Qwen2VLVideoProcessor``
        makes them (an odd last patch repeats the last frame), or ``Qwen3VLVideoProcessor`` where the video pixel
        budget is set (the frames resized together by ``video_smart_resize``). ``sampled_fps``: frames per second of
        the sampled frames (``len(indices) / total * video_fps``), for ``second_per_grid_t``; transformers' default 24
        if None."""
        if len(frames) < self.temporal_patch_size:
            raise QwenVisionInputError(
                f"video of {len(frames)} frame(s): Qwen-VL takes frames in temporal patches of "
                f"{self.temporal_patch_size}; a video needs at least {self.temporal_patch_size} frames (give a single "
                "frame as an image)")
        arrays = [_uint8_chw(frame) for frame in frames]
        sizes = sorted({tuple(a.shape[1:]) for a in arrays})
        if len(sizes) > 1:
            raise QwenVisionInputError(f"video frames of {len(sizes)} sizes (height, width): {sizes}; a video's "
                                       "frames share one size")
        stacked = torch.stack(arrays)  # [T, 3, H, W]
        pixels = self._resized(stacked, self.resized_size(*stacked.shape[-2:], frames=len(frames)))
        if pad := -len(frames) % self.temporal_patch_size:
            pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
        patches, grid = self._patchify(pixels.view(-1, self.temporal_patch_size, *pixels.shape[1:]))
        return QwenVisual(patches, grid, self.temporal_patch_size / (sampled_fps or 24))

    def still_patches(self, pixels: torch.Tensor) -> QwenVisual:
        """A normalised ``[3, H, W]`` float image whose sides are multiples of ``factor`` (already at a size the tower
        takes: not resized) as one still image's patches and grid."""
        height, width = pixels.shape[-2:]
        if pixels.dim() != 3 or height % self.factor or width % self.factor:
            raise QwenVisionInputError(f"a pixel tensor of shape {tuple(pixels.shape)} for a Qwen-VL tower; valid: "
                                       f"[3, H, W] with H and W multiples of {self.factor} px (or PIL images through "
                                       "the qwen_vl_image processor, which resizes them)")
        frames = pixels[None, None].expand(-1, self.temporal_patch_size, -1, -1, -1)
        return QwenVisual(*self._patchify(frames))

    def _resized(self, images: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        """``[N, 3, H, W]`` uint8 -> resized to ``size`` (default: an image's ``smart_resize``), normalised float32
        (transformers' fused rescale and normalisation: mean and std scaled by 255, applied to the 0..255 values)."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as tvF

        size = size or self.resized_size(*images.shape[-2:])
        resized = tvF.resize(images, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)
        mean = (torch.tensor(self.mean) * (1.0 / (1 / 255))).tolist()
        std = (torch.tensor(self.std) * (1.0 / (1 / 255))).tolist()
        return tvF.normalize(resized.to(torch.float32), mean, std)

    def _patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[t, temporal_patch_size, 3, H, W]`` -> ``([t*h*w, 3*tps*p*p], grid [3])``, patches ordered by merge
        window (window row, window column, row in window, column in window), as transformers orders them."""
        grid_t, tps, channels, height, width = frames.shape
        p, m = self.patch_size, self.merge_size
        grid_h, grid_w = height // p, width // p
        patches = frames.reshape(grid_t, tps, channels, grid_h // m, m, p, grid_w // m, m, p)
        # -> [t, window row, window col, row in window, col in window, channel, frame, pixel row, pixel col]
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, channels * tps * p * p)
        return flat, torch.tensor([grid_t, grid_h, grid_w], dtype=torch.long)


@reg.processors.register("qwen_vl_image")
class QwenVLImageProcessor(BaseProcessor):
    """A Qwen-VL tower's processing as a dataset processor: PIL image -> :class:`QwenVisual` (patches and grid).

    Left out, its keys are the model's Qwen-VL tower's (filled in when the run config is loaded), else Qwen's
    published defaults. Training and evaluation use the same processing (Qwen-VL trains without augmentation)."""

    FROM_TOWER: ClassVar[bool] = True
    TOWER_KEYS: ClassVar[tuple[str, ...]] = tuple(QwenVLProcessing().processor_keys())

    def __init__(self, *, min_pixels: int | None = None, max_pixels: int | None = None,
                 mean: list[float] | None = None, std: list[float] | None = None, patch_size: int | None = None,
                 merge_size: int | None = None, temporal_patch_size: int | None = None,
                 video_fps: float | None = None, video_min_frames: int | None = None,
                 video_max_frames: int | None = None, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None) -> None:
        """
        Args:
            min_pixels: Least area an image is resized to (default 56*56).
            max_pixels: Most area an image is resized to (default 28*28*1280: at most 1280 LLM tokens).
            mean: Per-channel mean (default OpenAI CLIP's).
            std: Per-channel std.
            patch_size: The tower's patch side (14).
            merge_size: Patches per side of one LLM token (2).
            temporal_patch_size: Frames per patch (2).
            video_fps: Frames sampled per second of a video file (Qwen3-VL's tower: 2); unset, a video gives the
                dataset's ``max_frames`` frames, uniformly.
            video_min_frames: Fewest frames ``video_fps`` samples (4).
            video_max_frames: Most frames ``video_fps`` samples (768).
            video_min_pixels: Least area of a video's frames together (Qwen3-VL's tower: 128*32*32); unset, each
                frame is bounded as an image.
            video_max_pixels: Most area of a video's frames together (Qwen3-VL's tower: 768*32*32).
        """
        given = dict(min_pixels=min_pixels, max_pixels=max_pixels, mean=None if mean is None else tuple(mean),
                     std=None if std is None else tuple(std), patch_size=patch_size, merge_size=merge_size,
                     temporal_patch_size=temporal_patch_size, video_fps=video_fps, video_min_frames=video_min_frames,
                     video_max_frames=video_max_frames, video_min_pixels=video_min_pixels,
                     video_max_pixels=video_max_pixels)
        self.processing = QwenVLProcessing(**{k: v for k, v in given.items() if v is not None})
        for key, value in self.processing.processor_keys().items():
            setattr(self, key, value)

    def __call__(self, image: Image.Image) -> QwenVisual:
        return self.processing.image(image)

    def tokens_for_image(self, grid_thw: Sequence[int] | torch.Tensor) -> int:
        """LLM tokens of an image this processor made, from its grid row: the count the model's ``tokens_for_image``
        gives it (show-sample reserves placeholders by it without building the model)."""
        return tokens_for_grid(grid_thw, self.merge_size)

    def grid_of_size(self, height: int, width: int) -> tuple[int, int, int]:
        """The grid row (t, h, w) this processor gives an image of ``height`` x ``width`` px (before resizing): what a
        dataset tells a token budget's planning without decoding the image (``datasets.lengths``)."""
        return self.processing.grid(height, width)

    def video_frame_count(self, total_frames: int, file_fps: float | None) -> int | None:
        """Frames this processor samples of a video file (``QwenVLProcessing.video_frame_count``); None: it has no
        rate of its own (the dataset's ``max_frames``)."""
        return self.processing.video_frame_count(total_frames, file_fps)

    def grid_of_video(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        """The grid row (t, h, w) of ``frames`` sampled frames of ``height`` x ``width`` px: what a token budget
        counts a video record by from its file's header (``datasets.lengths``)."""
        return self.processing.grid(height, width, frames)

    def sample_fields(self, visuals: Sequence[Image.Image], video: bool = False, fps: float | None = None,
                      frame_seconds: Sequence[float] | None = None) -> dict[str, Any]:
        """A sample's visual fields: its images (``video``: the frames of one video, a single visual) as flat patches
        end to end (``image``), a grid row each (``image_grid_thw``), their ``second_per_grid_t`` (a video's from
        ``fps``, the rate its frames sample it at; transformers' default 24 where the file tells none) and their
        frame times (``video_frame_seconds``: a video's ``frame_seconds``, each frame's time in the file)."""
        made = [self.processing.video(visuals, fps)] if video else [self.processing.image(v) for v in visuals]
        times = [tuple(frame_seconds) if video and frame_seconds is not None else None for _ in made]
        return {"image": torch.cat([v.pixel_values for v in made]), GRID_KEY: torch.stack([v.grid_thw for v in made]),
                SECONDS_KEY: [v.second_per_grid_t for v in made], FRAME_SECONDS_KEY: times}
