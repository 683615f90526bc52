"""A video written frame group by frame group, as Qwen3-VL's processor writes it.

Qwen3-VL's processor writes a video inside the span its chat template gives the video: each temporal patch of
frames (a frame group) after the text ``<{seconds:.1f} seconds>`` of its time, its placeholders in a vision span of
their own. A frame group's time is the mean of its first and last frame's times (``_calculate_timestamps``).

The batch carries a video's grid (t, h, w), its seconds per temporal patch (``second_per_grid_t``) and, where its
dataset read it from a file, each sampled frame's time in the file (``video_frame_seconds``: its frame number over
the file's frame rate, as transformers times the frames its sampler takes). A video without frame times has its
frames taken as indexes 0, 1, ... at the sampled rate ``frames_per_group / second_per_grid_t``: the times
transformers gives every frame of a file (or frames at a whole-number stride of it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from lavis_ds.common.errors import LavisDsError
from lavis_ds.models.image_tokens import FRAME_SECONDS_KEY, SECONDS_KEY, image_sizes, video_flags


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


def timed_group_seconds(frame_seconds: Sequence[float], groups: int, frames_per_group: int, where: str = "a video"
                        ) -> tuple[float, ...]:
    """Each frame group's time from its frames' own times, as Qwen3-VL's processor computes it
    (``_calculate_timestamps``): an odd last group repeats the last frame, each group's time is the mean of its first
    and last frame's. Raises where the frames do not fill the ``groups`` of the video's grid."""
    times = list(frame_seconds)
    times += times[-1:] * (-len(times) % frames_per_group)
    if len(times) != groups * frames_per_group:
        raise LavisDsError(f"{where}: {groups} frame group(s) of {frames_per_group} frames (its grid) but "
                           f"{len(frame_seconds)} frame time(s) ({FRAME_SECONDS_KEY}); valid: a time for each sampled "
                           f"frame, {groups * frames_per_group - frames_per_group + 1} to {groups * frames_per_group}")
    return tuple((times[i] + times[i + frames_per_group - 1]) / 2 for i in range(0, len(times), frames_per_group))


def frame_group_marks(samples: dict[str, Any], frames_per_group: int, span: tuple[str, str]
                      ) -> list[bool | FrameGroups]:
    """Each visual of a batch in flat image order: a video's ``FrameGroups`` (timed by its frames' own times where
    the batch carries them, else evenly), False for an image."""
    seconds, frame_seconds = samples.get(SECONDS_KEY), samples.get(FRAME_SECONDS_KEY)
    marks: list[bool | FrameGroups] = []
    for i, (video, size) in enumerate(zip(video_flags(samples), image_sizes(samples), strict=True)):
        if not video:
            marks.append(False)
        elif frame_seconds is not None and frame_seconds[i] is not None:
            times = timed_group_seconds(frame_seconds[i], int(size[0]), frames_per_group, f"video {i} of the batch")
            marks.append(FrameGroups(times, span))
        else:
            marks.append(FrameGroups(frame_group_seconds(int(size[0]), float(seconds[i]), frames_per_group), span))
    return marks
