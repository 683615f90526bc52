"""Where numbers go first: metrics.jsonl (one JSON object per line), rank 0 only. Trackers (TensorBoard, MLflow,
W&B) are hooks that receive the same records (``lavis_ds.runners.hooks.trackers``)."""
from __future__ import annotations

import json
from pathlib import Path

from lavis_ds.common.errors import OutputError


class MetricsWriter:
    """Appends records to ``<output_dir>/metrics.jsonl``.

    After a resume at ``resume_step`` the lines of steps that will be trained again
    are dropped, so the file reads like one uninterrupted run. A write that fails (a full
    disk) is an ``OutputError`` naming the file: the run stops with one line, not a traceback.
    """

    def __init__(self, output_dir: str | Path, resume_step: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.failed = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                kept = "".join(line + "\n" for line in _lines_up_to(self.path, resume_step))
                tmp = self.path.with_suffix(".jsonl.tmp")
                tmp.write_text(kept)
                tmp.replace(self.path)  # atomic: a kill now leaves the old file or the new one
            self.file = self.path.open("a")
        except OSError as e:
            raise OutputError.writing("the metrics file", self.path, e) from None

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            self.failed = True
            raise OutputError.writing("the metrics file", self.path, e) from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as e:
            if not self.failed:  # else the lines that could not be written were reported already
                raise OutputError.writing("the metrics file", self.path, e) from None


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The lines of ``path`` whose step is at most ``step``; a line cut short by a kill is dropped."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
    return kept


# Upstream deprecation notices that fire on every step, from code lavis_ds does not own
# (DeepSpeed ZeRO-3 calling torch.distributed's renamed collectives). Python's own "once" filter
# does not hold them back in a training process (its registry is bypassed there; seen with
# DeepSpeed 0.19.8 and torch 2.14), and at every step they break the progress bar.
KNOWN_UPSTREAM_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
)


def show_known_warnings_once() -> None:
    """Show each known upstream deprecation notice once per process instead of once per step."""
    import re
    import warnings

    known = [(category, re.compile(pattern)) for category, pattern in KNOWN_UPSTREAM_WARNINGS]
    shown: set[str] = set()
    show = warnings.showwarning

    def show_once(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if any(issubclass(category, c) and pattern.match(text) for c, pattern in known):
            if text in shown:
                return
            shown.add(text)
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once
