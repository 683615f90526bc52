"""The errors whose message is the whole answer.

train.py and export.py print a :class:`LavisDsError` as one ``lavis_ds: <message>``
on stderr and exit with its ``exit_code``, without a traceback: the message names
the file, key, record or step and says what would be valid. Anything else is a bug
and keeps its traceback.
"""
from __future__ import annotations

import re
import sys
from typing import Iterable


class LavisDsError(Exception):
    """A failure the message fully explains. ``exit_code`` 1: a fault found while running.
    ``same_on_every_rank``: every process raises it alike (a config), so one of them reports it."""

    exit_code = 1
    same_on_every_rank = False


class InputError(LavisDsError):
    """Bad input - a file, a record, a checkpoint, a setting - that the user must change: exit code 2."""

    exit_code = 2


class OutputError(LavisDsError):
    """A run's output (metrics, predictions) could not be written: a full disk, a quota, a read-only folder."""

    @classmethod
    def writing(cls, what: str, path, error: OSError) -> OutputError:
        reason = error.strerror or str(error)
        return cls(f"cannot write {what} {path}: {reason}; the run stopped here. Free space (or fix the folder), then "
                   "run the same command: it continues from the newest complete checkpoint")


class CheckpointError(InputError, ValueError):
    """A checkpoint or weights file that cannot be loaded, resumed from or exported: wrong format, unexpected or
    missing keys, wrong shapes, another engine's layout. The message names the folder or file."""


class ConfigError(InputError, ValueError):
    """Every problem found in a run config, one per line (raised by ``lavis_ds.config.load_config``). Every rank
    loads the same config and finds the same problems: one reports them."""

    same_on_every_rank = True

    def __init__(self, problems: Iterable[str], source: str = "config"):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n" +
                         "\n".join(f"  - {p}" for p in self.problems))


class ImageSpanCut(LavisDsError, ValueError):
    """Truncation at ``max_len`` would cut into (or drop) a sample's image placeholders: the sample cannot be kept
    whole, so ``prepare_batch`` drops it or refuses it (``run.sft.on_image_cut``). Raised by
    ``lavis_ds.models.prompt.ChatPrompt``."""

    def __init__(self, max_len: int, last_image_pos: int, length: int, where: str = "a sample"):
        super().__init__(f"{where}: max_txt_len={max_len} would cut the image placeholders of its {length} tokens "
                         f"(the last one is token {last_image_pos}); raise model.max_txt_len, or set "
                         "run.sft.on_image_cut: drop to leave such samples out")
        self.max_len, self.last_image_pos, self.length, self.where = max_len, last_image_pos, length, where

    def at(self, where: str) -> "ImageSpanCut":
        """The same cut, naming the sample."""
        return type(self)(self.max_len, self.last_image_pos, self.length, where)

    def __reduce__(self):  # picklable although __init__ takes more than the message
        return type(self), (self.max_len, self.last_image_pos, self.length, self.where)


# torch's DataLoader re-raises a worker's exception as ``type(msg)`` with the worker's
# formatted traceback inside the message; the original message is its last entry.
_WORKER_WRAPPER = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback", re.S)


def message_of(error: BaseException) -> str:
    """The error's own message, without the traceback a DataLoader worker wrapped it in."""
    text = str(error)
    if not _WORKER_WRAPPER.match(text):
        return text
    cls = type(error)
    head = f"\n{cls.__module__}.{cls.__qualname__}: "
    start = text.rfind(head)
    return text[start + len(head):].strip() if start >= 0 else text


def report(message: str) -> None:
    """``lavis_ds: <message>`` on stderr, on a line of its own above any progress bar."""
    from tqdm import tqdm

    tqdm.write(f"lavis_ds: {message}", file=sys.stderr)
