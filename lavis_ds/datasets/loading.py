"""Load annotation files of any format into records, and decide what a bad record does.

Every record is checked when its file is loaded - its structure by the format's
parser, the existence of its image file here - so a bad record is reported on
the main process with its file and position before training starts, not inside
a DataLoader worker hours later. Existence costs one directory listing per image
folder; whether an image *decodes* is only known when it is opened, which the
dataset does per sample (opening hundreds of thousands of images at load time
would take longer than many training runs).

By default the first bad records raise :class:`BadRecordsError`. A loader built
with ``skip`` leaves the records of those kinds out and reports them in
:attr:`LoadedRecords.skipped`, so the caller can log how many and which.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

from lavis_ds.datasets.records import BadRecord, InstructionRecord

# A format: the file's parsed JSON and its path in, records (or the reason each is bad) out.
# File-level problems (wrong top-level type) raise ValueError naming the file.
ParseFile = Callable[[Any, Path], Iterable[InstructionRecord | BadRecord]]

ALL_KINDS = frozenset({BadRecord.MALFORMED, BadRecord.MISSING_IMAGE, BadRecord.TEXT_ONLY})
MAX_SHOWN = 5  # bad records quoted in an error or warning; the rest are counted


def read_json(path: Path) -> Any:
    """The parsed content of one annotation file; errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"annotation file {path} does not exist")
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: {e}") from None


class ImageFolderIndex:
    """Answers "does this image file exist?" with one directory listing per folder.

    A ``stat`` per record is slow on network file systems (LLaVA's mix665k has
    665k records in six folders). Names missing from a listing are checked once
    more with ``is_file``, so case-insensitive file systems are not misjudged.
    """

    def __init__(self, root: Path):
        self.root = root
        self._listings: dict[Path, frozenset[str]] = {}

    def exists(self, relative: str) -> bool:
        path = self.root / relative
        names = self._listings.get(path.parent)
        if names is None:
            try:
                names = frozenset(os.listdir(path.parent))
            except OSError:  # missing folder, or a file where a folder should be
                names = frozenset()
            self._listings[path.parent] = names
        return path.name in names or path.is_file()


class BadRecordsError(ValueError):
    """Bad records found at load time; the message quotes the first few with file and position."""

    def __init__(self, bad: Sequence[BadRecord]):
        self.bad = list(bad)
        super().__init__("\n".join(describe_bad(self.bad)) +
                         "\n(set `skip_bad_records: true` in the dataset section to skip bad records; "
                         "they are counted in the log)")


def describe_bad(bad: Sequence[BadRecord]) -> list[str]:
    """One line per quoted bad record, then a count of the rest."""
    head = f"{len(bad)} bad record(s):" if len(bad) > 1 else "bad record:"
    lines = [head] + [f"  {b}" for b in bad[:MAX_SHOWN]]
    if len(bad) > MAX_SHOWN:
        lines.append(f"  ... and {len(bad) - MAX_SHOWN} more")
    return lines


@dataclass
class LoadedRecords:
    records: list[InstructionRecord]
    skipped: list[BadRecord] = field(default_factory=list)

    def skip_summary(self) -> str:
        """What was skipped: counts by kind and the first few records (empty if nothing was)."""
        if not self.skipped:
            return ""
        kinds: dict[str, int] = {}
        for b in self.skipped:
            kinds[b.kind] = kinds.get(b.kind, 0) + 1
        total = len(self.records) + len(self.skipped)
        counts = ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in sorted(kinds.items()))
        return (f"skipped {len(self.skipped)} of {total} record(s) ({counts}); the first:\n" +
                "\n".join(describe_bad(self.skipped)[1:]))


class RecordLoader:
    """Reads annotation files with one format's parser and applies one skip policy.

    Args:
        parse: the format (see :data:`ParseFile`).
        skip: kinds of bad record to leave out instead of raising (:data:`ALL_KINDS` for all).
        check_images: check that every record's image file exists (needs an image root).

    Files are parsed once per loader: a builder's ``check()`` and ``build()`` share the work.
    """

    def __init__(self, parse: ParseFile, *, skip: Collection[str] = (), check_images: bool = True):
        unknown = set(skip) - ALL_KINDS
        if unknown:
            raise ValueError(f"unknown kind(s) of bad record {sorted(unknown)}; known: {sorted(ALL_KINDS)}")
        self.parse, self.skip, self.check_images = parse, frozenset(skip), check_images
        self._files: dict[tuple[Path, Path | None], tuple[list[InstructionRecord], list[BadRecord]]] = {}
        self._image_indexes: dict[Path, ImageFolderIndex] = {}  # splits and files share an image root's listings

    def read(self, path: Path, image_root: Path | None) -> tuple[list[InstructionRecord], list[BadRecord]]:
        """Every good record of one file and every bad one; file-level problems raise ``ValueError``."""
        key = (Path(path), image_root)
        if key not in self._files:
            self._files[key] = self._read(*key)
        return self._files[key]

    def _read(self, path: Path, image_root: Path | None) -> tuple[list[InstructionRecord], list[BadRecord]]:
        images = None
        if self.check_images and image_root is not None:
            images = self._image_indexes.setdefault(image_root, ImageFolderIndex(image_root))
        records, bad = [], []
        for item in self.parse(read_json(path), path):
            if isinstance(item, BadRecord):
                bad.append(item)
            elif images is not None and not images.exists(item.image):
                bad.append(BadRecord(item.where(), f"image file {image_root / item.image} not found "
                                                   f"(image root {image_root})", BadRecord.MISSING_IMAGE))
            else:
                records.append(item)
        return records, bad

    def load(self, paths: Sequence[Path], image_root: Path | None) -> LoadedRecords:
        """The records of ``paths`` in order; raises :class:`BadRecordsError` unless the bad ones may be skipped."""
        records, skipped, fatal = [], [], []
        for path in paths:
            good, bad = self.read(path, image_root)
            records += good
            for b in bad:
                (skipped if b.kind in self.skip else fatal).append(b)
        if fatal:
            raise BadRecordsError(fatal)
        if not records:
            names = ", ".join(str(p) for p in paths)
            raise ValueError(f"{names}: no usable record" + (f" (all {len(skipped)} were skipped as bad)"
                                                             if skipped else " (the file lists none)"))
        return LoadedRecords(records, skipped)
