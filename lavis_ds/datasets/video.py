"""Video records: up to ``max_frames`` frames sampled uniformly over the video, decoded with PyAV.

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
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from lavis_ds.common.errors import InputError


class UnreadableVideoError(InputError, OSError):
    """A video file that does not decode, or holds no frame; the message names the file and the record."""


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


def read_frames(path: Path, max_frames: int, where: str = "") -> list[Image.Image]:
    """Up to ``max_frames`` RGB frames of the video at ``path``, uniformly sampled, in order.

    Raises :class:`UnreadableVideoError` (``where`` names the record) when the file does not
    decode or holds no video frame.
    """
    prefix = f"{where}: " if where else ""
    try:
        with _open(path) as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            wanted = uniform_indices(_frame_count(container, stream), max_frames)
            frames = _decode(container, stream, wanted)
    except InputError:
        raise
    except Exception as e:  # PyAV raises its own errors (InvalidDataError, ...), OSError, ValueError
        raise UnreadableVideoError(f"{prefix}cannot read video file {path}: {type(e).__name__}: {e}") from e
    if not frames:
        raise UnreadableVideoError(f"{prefix}video file {path} holds no decodable frame")
    return frames


def _decode(container, stream, wanted: list[int]) -> list[Image.Image]:
    """The frames numbered ``wanted`` (sorted), decoding in order and converting only those."""
    frames, want = [], set(wanted)
    last = wanted[-1] if wanted else -1
    for number, frame in enumerate(container.decode(stream)):
        if number in want:
            frames.append(frame.to_image().convert("RGB"))
        if number >= last:
            break
    return frames

