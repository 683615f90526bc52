"""How many LLM tokens each image of a batch takes, and the flat features that fill them.

One count serves both sides of the splice. ``ImageLayout.counts(samples)`` (the model's ``images``) asks
``tokens_for_image(size)`` for every image of a batch; ``prepare_batch`` reserves exactly that many placeholders
per image in the prompt and keeps the list in the batch (``image_tokens``); the splice checks that the image path
gave exactly that many feature rows for the batch. Neither side computes a count of its own, so the two cannot
disagree (transformers computes the count twice for LLaVA-OneVision, which is where "image features and image
tokens do not match" comes from).

An image's size is what the batch carries for it: its row of ``image_grid_thw`` (t, h, w patches) when the batch
has one (Qwen-VL processing: ``image`` is then the flat ``[sum t*h*w, D]`` of every image's patches), otherwise the
(height, width) of its pixels in the ``[N, 3, H, W]`` ``image`` tensor, or the ``image_sizes`` a batch made for
counting alone lists (``lavis_ds.datasets.lengths``). Features travel flat: ``[sum of counts, llm_hidden]``, each
image's rows a block, in image order.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from lavis_ds.common.errors import LavisDsError
# GRID_KEY: [N, 3] (t, h, w) patches per image, with flat patch pixels; SECONDS_KEY: per image seconds of video per
# temporal patch (None for a still image), Qwen2.5-VL's absolute-time positions. Named where the processor makes them.
# FRAME_SECONDS_KEY: per image a video's frame times in its file (None: an image, or a video timed evenly).
from lavis_ds.processors.qwen_vl import FRAME_SECONDS_KEY, GRID_KEY, SECONDS_KEY  # noqa: F401  (re-exported)

SIZES_KEY = "image_sizes"  # per image sizes of a batch that holds no pixels (token counting)
Size = tuple[int, ...]


def batch_images(samples: dict[str, Any]) -> int:
    """How many images a batch holds: its grid rows, its listed sizes, else the rows of its ``image`` tensor."""
    for key in (GRID_KEY, SIZES_KEY):
        if samples.get(key) is not None:
            return len(samples[key])
    image = samples.get("image")
    return 0 if image is None else int(image.shape[0])


def image_sizes(samples: dict[str, Any]) -> list[Size]:
    """Each image's size, in flat image order (see the module docstring for what a size is)."""
    for key in (GRID_KEY, SIZES_KEY):
        if samples.get(key) is not None:
            sizes = samples[key]
            return [tuple(int(v) for v in size) for size in (sizes.tolist() if torch.is_tensor(sizes) else sizes)]
    image = samples.get("image")
    if image is None or not image.shape[0]:
        return []
    return [tuple(int(v) for v in image.shape[-2:])] * int(image.shape[0])


def video_flags(samples: dict[str, Any]) -> list[bool]:
    """Whether each visual of a batch is a video, in flat image order: a video has its seconds per temporal patch
    (``SECONDS_KEY``, which a still image leaves None); a batch without them holds images only."""
    seconds = samples.get(SECONDS_KEY)
    if seconds is None:
        return [False] * batch_images(samples)
    return [second is not None for second in seconds]


def per_sample(values: Sequence[int], images_per_sample: Sequence[int]) -> list[list[int]]:
    """A flat per-image list cut into each sample's images."""
    out, start = [], 0
    for n in images_per_sample:
        out.append(list(values[start:start + n]))
        start += n
    return out


def images_per_sample(samples: dict[str, Any], counts: Sequence[int]) -> list[int]:
    """Images per sample for naming a sample in a message: the batch's ``num_images`` where they add up to the
    images ``counts`` holds, else all of them as one sample (the counts are not the samples': a preference pair's
    sides share the pair's images)."""
    nums = [int(n) for n in samples.get("num_images") or ()]
    return nums if sum(nums) == len(counts) else [len(counts)]


def image_rows(samples: dict[str, Any]) -> list[int]:
    """Rows of ``image`` each image takes: its t*h*w patches with a grid, else one (an ``[N, 3, H, W]`` tensor)."""
    grid = samples.get(GRID_KEY)
    if grid is None:
        return [1] * batch_images(samples)
    return [t * h * w for t, h, w in image_sizes(samples)]


def select_images(samples: dict[str, Any], order: Sequence[int]) -> dict[str, Any]:
    """The batch's image fields (``image``, its grid, sizes, video seconds and frame times) with the images listed in
    ``order``."""
    image = samples.get("image")
    out: dict[str, Any] = {}
    if image is not None and image.shape[0]:
        rows = image_rows(samples)
        starts = [sum(rows[:i]) for i in range(len(rows))]
        index = torch.tensor([starts[i] + k for i in order for k in range(rows[i])], dtype=torch.long)
        out["image"] = image[index.to(image.device)]
    for key in (GRID_KEY, SIZES_KEY, SECONDS_KEY, FRAME_SECONDS_KEY):
        value = samples.get(key)
        if value is not None:
            out[key] = value[torch.tensor(list(order), dtype=torch.long)] if torch.is_tensor(value) \
                else [value[i] for i in order]
    return out


def check_feature_rows(rows: int, counts: Sequence[int], images_per_sample: Sequence[int],
                       image_path: str) -> None:
    """Raise naming the first sample whose images the ``rows`` feature rows do not cover exactly, when they are not
    ``sum(counts)`` (host integers only: no device sync on the way)."""
    if rows == sum(counts):
        return
    covered = 0
    for sample, mine in enumerate(per_sample(counts, images_per_sample)):
        covered += sum(mine)
        if covered > rows or sample == len(images_per_sample) - 1:
            break
    raise LavisDsError(
        f"sample {sample} of the batch: its {len(mine)} image(s) take {mine} placeholder tokens (the model's "
        f"tokens_for_image), but {image_path} has {rows} feature rows for the batch's {len(counts)} image(s), which "
        f"need {sum(counts)}; an image path must give tokens_for_image(size) rows per image")


def flat_features(features: torch.Tensor, counts: Sequence[int], images_per_sample: Sequence[int],
                  image_path: str) -> torch.Tensor:
    """``[N, T, hidden]`` (a fixed count per image) or ``[sum counts, hidden]`` as the flat ``[rows, hidden]``,
    checked against ``counts``; a 3-D one whose T differs from an image's count names that image's sample."""
    if features.dim() == 3:
        wrong = [i for i, n in enumerate(counts) if n != features.shape[1]]
        if wrong:
            sample = next(s for s, end in enumerate(_ends(images_per_sample)) if wrong[0] < end)
            raise LavisDsError(f"sample {sample} of the batch: image {wrong[0]} takes {counts[wrong[0]]} placeholder "
                               f"tokens (the model's tokens_for_image), but {image_path} gave {features.shape[1]} "
                               "feature rows per image")
        features = features.flatten(0, 1)
    check_feature_rows(features.shape[0], counts, images_per_sample, f"the output of {image_path}")
    return features


def _ends(counts: Sequence[int]) -> list[int]:
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    return ends
