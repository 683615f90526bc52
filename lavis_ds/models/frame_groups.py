"""A video written frame group by frame group, as Qwen3-VL's processor writes it.

Qwen3-VL's processor writes a video inside the span its chat template gives the video: each temporal patch of
frames (a frame group) after the text ``<{seconds:.1f} seconds>`` of its time, its placeholders in a vision span of
their own. A frame group's time is the mean of its first and last frame's times (``_calculate_timestamps``).

The batch carries a video's grid (t, h, w) and its seconds per temporal patch (``second_per_grid_t``); the frames
are taken as indexes 0, 1, ... at the sampled rate ``frames_per_group / second_per_grid_t``: the times transformers
gives every frame of a file (or frames at a whole-number stride of it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lavis_ds.models.image_tokens import SECONDS_KEY, image_sizes, video_flags


@dataclass(frozen=True)
class FrameGroups:
    """One video's frame groups: each one's time in seconds, in order, and the text around each group's
    placeholders (``<|vision_start|>``, ``<|vision_end|>``)."""

    seconds: tuple[float, ...]
    span: tuple[str, str]

    def run(self, token: str, count: int) -> str:
        """The placeholder text of the whole video: ``count`` placeholders, an equal share per frame group."""
        per_group, left = divmod(count, len(self.seconds))
        if left:
            raise ValueError(f"a video of {len(self.seconds)} frame groups cannot take {count} placeholders")
        start, end = self.span
        return "".join(f"<{second:.1f} seconds>{start}{token * per_group}{end}" for second in self.seconds)


def frame_group_seconds(groups: int, second_per_grid_t: float, frames_per_group: int) -> tuple[float, ...]:
    """Each frame group's time, computed as Qwen3-VL's processor computes it: every frame's index over the frame
    rate, then the mean of each group's first and last frame."""
    fps = frames_per_group / second_per_grid_t
    times = [index / fps for index in range(groups * frames_per_group)]
    return tuple((times[i] + times[i + frames_per_group - 1]) / 2 for i in range(0, len(times), frames_per_group))


def frame_group_marks(samples: dict[str, Any], frames_per_group: int, span: tuple[str, str]
                      ) -> list[bool | FrameGroups]:
    """Each visual of a batch in flat image order: a video's ``FrameGroups``, False for an image."""
    seconds = samples.get(SECONDS_KEY)
    return [FrameGroups(frame_group_seconds(int(size[0]), float(seconds[i]), frames_per_group), span)
            if video else False
            for i, (video, size) in enumerate(zip(video_flags(samples), image_sizes(samples), strict=True))]
