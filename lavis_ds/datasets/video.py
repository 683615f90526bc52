"""Video records: up to ``max_frames`` frames sampled uniformly over the video (or as many as a processor's own
sampling asks for: Qwen3-VL's 2 frames a second), decoded with PyAV.

MPP-LLaVA (``lavis/datasets/datasets/video_instructions.py``) reads a video with moviepy
and OpenCV, takes every ``total // max_frames``-th frame, and on any failure prints and
substitutes a random other record. Here frames are spread evenly from the first to the
last (``linspace``, as Video-LLaVA and Hugging Face's video examples sample), decoding is
PyAV's (FFmpeg in a wheel: mp4, mkv, webm, avi, ...), and a video that does not decode
raises an error naming the file and the record.

A video with fewer frames than ``max_frames`` gives all of its frames, one marker each:
the prompt is built from the frames actually read, so nothing mismatches, and short clips
are ordinary data (MPP-LLaVA takes every frame of such a clip too). The dataset logs a
note for the first few.

The frames come with the rate they sample the video at (``SampledFrames.fps``: frames taken / frames in the file x
the file's frame rate, as transformers' ``VideoMetadata.sampled_fps``; the file's rate from its stream, else from the
first and last frame's timestamps): Qwen2.5-VL spaces a video's temporal positions by it.
``video_header`` tells a video's frame size and count without decoding a frame (a token budget counts by them).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from PIL import Image

from lavis_ds.common.errors import InputError
from lavis_ds.processors.qwen_vl_video import UNKNOWN_FILE_FPS


class UnreadableVideoError(InputError, OSError):
    """A video file that does not decode, or holds no frame; the message names the file and the record."""


class SampledFrames(list):
    """The frames sampled from a video, in order (a list of RGB images); ``fps``: how many of them fall in one
    second of the video (None where the file tells no rate); ``seconds``: each frame's time in the file, its frame
    number over the file's frame rate (24 where the file tells none), as transformers' Qwen3-VL processor times the
    frames it writes timestamps for."""

    def __init__(self, frames: list[Image.Image], fps: float | None, seconds: tuple[float, ...] | None = None):
        super().__init__(frames)
        self.fps = fps
        self.seconds = seconds


class VideoHeader(NamedTuple):
    """What a video file's header tells without decoding: its frame size, frame count and frame rate (None where
    its stream gives none)."""

    height: int
    width: int
    frames: int
    fps: float | None = None


def uniform_indices(total: int, count: int) -> list[int]:
    """``count`` frame numbers spread evenly over ``total`` frames, first and last included; every frame if fewer."""
    if total <= count:
        return list(range(total))
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def _open(path: Path):
    try:
        import av
    except ImportError:
        raise InputError(f"video file {path}: reading videos needs PyAV: pip install av "
                         "(or pip install 'lavis_ds[video]')") from None
    return av.open(str(path))


def _frame_count(container, stream) -> int:
    """Frames in the video stream: the container's count where it has one (mp4), else its packets counted
    (mkv and webm often give none); counting packets demuxes without decoding."""
    if stream.frames:
        return int(stream.frames)
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count


@contextlib.contextmanager
def _video_stream(path: Path, prefix: str):
    """The container at ``path`` and its first video stream; any failure to read them, or inside the block, becomes
    one :class:`UnreadableVideoError` naming the file (``prefix``: the record)."""
    try:
        with _open(path) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            yield container, container.streams.video[0]
    except InputError:
        raise
    except Exception as e:  # PyAV raises its own errors (InvalidDataError, ...), OSError, ValueError
        raise UnreadableVideoError(f"{prefix}cannot read video file {path}: {type(e).__name__}: {e}") from e


def read_frames(path: Path, max_frames: int | Callable[[int, float | None], int], where: str = "") -> SampledFrames:
    """Up to ``max_frames`` RGB frames of the video at ``path``, uniformly sampled, in order, with the rate they
    sample it at (``SampledFrames.fps``). ``max_frames`` may be a function of the file's frame count and frame rate
    (its stream's; None where it gives none) that says how many to take (a processor's own sampling: Qwen3-VL's
    2 frames a second).

    Raises :class:`UnreadableVideoError` (``where`` names the record) when the file does not
    decode or holds no video frame.
    """
    prefix = f"{where}: " if where else ""
    with _video_stream(path, prefix) as (container, stream):
        total = _frame_count(container, stream)
        count = max_frames(total, _stream_rate(stream)) if callable(max_frames) else max_frames
        frames, numbers, times = _decode(container, stream, uniform_indices(total, count))
        rate = _frame_rate(stream, total, times)
    if not frames:
        raise UnreadableVideoError(f"{prefix}video file {path} holds no decodable frame")
    seconds = tuple(number / (rate or UNKNOWN_FILE_FPS) for number in numbers)
    return SampledFrames(frames, None if rate is None else len(frames) / total * rate, seconds)


def video_header(path: Path, where: str = "") -> VideoHeader:
    """The frame size and count of the video at ``path`` from its container, decoding no frame (a container without a
    frame count, mkv or webm, has its packets counted). :class:`UnreadableVideoError` where it tells neither."""
    prefix = f"{where}: " if where else ""
    with _video_stream(path, prefix) as (container, stream):
        header = VideoHeader(int(stream.codec_context.height), int(stream.codec_context.width),
                             _frame_count(container, stream), _stream_rate(stream))
    if min(header[:3]) <= 0:
        raise UnreadableVideoError(f"{prefix}video file {path}: its header gives {header.width}x{header.height} px "
                                   f"and {header.frames} frame(s)")
    return header


def _stream_rate(stream) -> float | None:
    """The frames per second the video stream's header gives (its average rate, as transformers' PyAV reader takes
    it); None where it gives none."""
    return float(stream.average_rate) if stream.average_rate else None


def _frame_rate(stream, total: int, times: list[float]) -> float | None:
    """The file's frames per second: its stream's average rate, else from the decoded frames' first and last
    timestamps; None where neither tells."""
    if rate := _stream_rate(stream):
        return rate
    if len(times) > 1 and times[-1] > times[0]:
        return (total - 1) / (times[-1] - times[0])  # the last decoded frame is the file's last (uniform_indices)
    return None


def _decode(container, stream, wanted: list[int]) -> tuple[list[Image.Image], list[int], list[float]]:
    """The frames numbered ``wanted`` (sorted), decoding in order and converting only those, their numbers (those
    the file holds), and their timestamps (seconds; those the file gives)."""
    frames, numbers, times, want = [], [], [], set(wanted)
    last = wanted[-1] if wanted else -1
    for number, frame in enumerate(container.decode(stream)):
        if number in want:
            frames.append(frame.to_image().convert("RGB"))
            numbers.append(number)
            if frame.time is not None:
                times.append(float(frame.time))
        if number >= last:
            break
    return frames, numbers, times

