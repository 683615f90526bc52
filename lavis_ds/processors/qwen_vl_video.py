"""Qwen3-VL's own video sampling: frames at a rate (2 per second), and one pixel budget for the whole video.

transformers' ``Qwen3VLVideoProcessor`` differs from Qwen2-VL's video processor in two ways this module reproduces:

- **Which frames** (``frames_at_rate``): ``fps`` frames per second of the file (2 by default), at least
  ``min_frames`` (4) and at most ``max_frames`` (768) and the file's own frame count, spread evenly from the first
  frame to the last (``linspace``, rounded: ``datasets.video.uniform_indices``). A file that tells no frame rate
  counts as 24 fps, as transformers assumes.
- **How large** (``video_smart_resize``): the frames' size is chosen for the video as a whole: the area of all of
  its frames (frames rounded to whole temporal patches) lies within ``min_pixels`` .. ``max_pixels``, so a longer
  video has smaller frames. Qwen2-VL bounds each frame alone.

``QwenVLProcessing`` takes both as its ``video_*`` settings; Qwen3-VL's tower sets them (``SPEC.video_sampling``).
"""
from __future__ import annotations

import math

from lavis_ds.common.errors import InputError

# The published Qwen3-VL and Qwen3.5 folders' video processor (video_preprocessor_config.json): 2 frames a second,
# 4 to 768 frames (Qwen3VLVideoProcessor's defaults), a video's frames together between 4096 px and 24,576 merged
# tokens of 32 x 32 px (size shortest_edge / longest_edge; the class's own defaults, 128 and 768 merged tokens, hold
# only for a processor built without a folder). A published folder's own values replace these (``hf.qwen3_vl``).
QWEN3_VL_FPS = 2.0
QWEN3_VL_VIDEO_MIN_PIXELS = 4096
QWEN3_VL_VIDEO_MAX_PIXELS = 32 * 32 * 768 * 32
# the rate transformers assumes for a file that tells none
UNKNOWN_FILE_FPS = 24.0


class QwenVisionInputError(InputError, ValueError):
    """An image, video or setting Qwen-VL processing cannot take; the message says what would be valid."""


def frames_at_rate(total_frames: int, file_fps: float | None, fps: float, min_frames: int, max_frames: int) -> int:
    """How many frames Qwen3-VL's video processor samples of a file of ``total_frames`` frames at ``file_fps``:
    ``fps`` a second of the file, clamped to ``min_frames`` .. ``max_frames`` and the file's frame count
    (``Qwen3VLVideoProcessor.sample_frames``)."""
    if total_frames < 1:
        raise QwenVisionInputError(f"video of {total_frames} frame(s): nothing to sample")
    count = int(total_frames / (file_fps or UNKNOWN_FILE_FPS) * fps)
    return min(max(count, min_frames), max_frames, total_frames)


def video_smart_resize(frames: int, height: int, width: int, temporal_patch_size: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) Qwen3-VL's video processor resizes ``frames`` frames of ``height`` x ``width`` px to:
    multiples of ``factor`` nearest the frames' own size, the aspect ratio kept, with the area of the frames rounded
    to whole temporal patches within ``min_pixels`` .. ``max_pixels`` (transformers'
    ``video_processing_qwen3_vl.smart_resize``; a side under ``factor`` px is first scaled up to it)."""
    if frames < temporal_patch_size:
        raise QwenVisionInputError(f"video of {frames} frame(s): Qwen-VL takes frames in temporal patches of "
                                  f"{temporal_patch_size}; a video needs at least {temporal_patch_size} frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise QwenVisionInputError(f"video frames of {width}x{height} px (width x height) have an aspect ratio of "
                                  f"{ratio:.1f}, over the 200 Qwen-VL takes: crop or pad them to at most 200:1")
    whole_frames = round(frames / temporal_patch_size) * temporal_patch_size
    return fit_area(height, width, factor, min_pixels, max_pixels, frames, whole_frames)


def fit_area(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1,
             whole_frames: int = 1) -> tuple[int, int]:
    """Multiples of ``factor`` nearest ``height`` x ``width``, the aspect ratio kept, scaled so that ``whole_frames``
    frames of that size hold ``min_pixels`` .. ``max_pixels`` (the scale computed from the ``frames`` themselves):
    the fit of transformers' ``smart_resize``, for an image (one frame; ``processors.qwen_vl.smart_resize``) and a
    video (its frames together, rounded to whole temporal patches)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if whole_frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif whole_frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
