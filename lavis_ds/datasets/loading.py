"""Load annotation files of any format into records, and decide what a bad record does.

Every record is checked when its file is loaded - its structure by the format's
parser; here, for every format, that its ``<ImageHere>`` markers fit its images or
video and that each image or video file exists - so a bad record is reported on
the main process with its file and position before training starts, not inside
a DataLoader worker hours later. Existence costs one directory listing per image
folder; whether an image *decodes* is only known when it is opened, which the
dataset does per sample (opening hundreds of thousands of images at load time
would take longer than many training runs).

By default the first bad records raise :class:`BadRecordsError`. A loader built
with ``skip`` leaves the records of those kinds out and reports them in
:attr:`LoadedRecords.skipped`, so the caller can log how many and which.

A file's good records are kept packed (:mod:`lavis_ds.datasets.record_store`), never
as a list of objects, and a file is parsed once per :class:`ParsedFiles`.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Hashable, Iterable, Sequence

import orjson

from lavis_ds.datasets.record_store import RecordStore, RecordStoreWriter
from lavis_ds.datasets.records import BadRecord, InstructionRecord

# A format: the file's parsed JSON and its path in, records (or the reason each is bad) out.
# File-level problems (wrong top-level type) raise ValueError naming the file.
ParseFile = Callable[[Any, Path], Iterable[InstructionRecord | BadRecord]]

ALL_KINDS = frozenset({BadRecord.MALFORMED, BadRecord.MISSING_IMAGE, BadRecord.TEXT_ONLY})
MAX_SHOWN = 5  # bad records quoted in an error or warning; the rest are counted


def read_json(path: Path) -> Any:
    """The parsed content of one annotation file; errors name the file.

    orjson parses LLaVA-size files about twice as fast as the standard library; a file it
    refuses (invalid, or what only Python's json accepts: NaN, integers beyond 64 bits) is
    read again by ``json``, which gives the same result and error messages as before.
    """
    if not path.is_file():
        raise FileNotFoundError(f"annotation file {path} does not exist")
    if path.suffix == ".jsonl":  # one record per line (ms-swift's and LLaMA-Factory's datasets): read as a list
        return _read_json_lines(path)
    data = path.read_bytes()
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: {e}") from None


def _read_json_lines(path: Path) -> list:
    """A ``.jsonl`` file as the list of its records (blank lines skipped); a bad line is named by its number."""
    records = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    records.append(orjson.loads(line))
                except orjson.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {number} is not valid JSON: {e}") from None
    return records


@contextlib.contextmanager
def collector_paused():
    """No cyclic garbage collection inside: while a file is parsed, millions of new containers (its records'
    dicts and lists) stay alive until it is packed, and the collector would walk them again and again
    (minutes for LLaVA's mix665k). They hold no reference cycles; the collector resumes afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ImageFolderIndex:
    """Answers "does this image file exist?" with one directory listing per folder.

    A ``stat`` per record is slow on network file systems (LLaVA's mix665k has
    665k records in six folders). Names missing from a listing are checked once
    more with ``is_file``, so case-insensitive file systems are not misjudged.
    """

    def __init__(self, root: Path):
        self.root = root
        self._listings: dict[str, frozenset[str]] = {}

    def exists(self, relative: str) -> bool:
        # Split as a string: pathlib objects per record cost more than the whole listing.
        folder, _, name = relative.rpartition("/")
        names = self._listings.get(folder)
        if names is None:
            try:
                names = frozenset(os.listdir(os.path.join(self.root, folder)))
            except OSError:  # missing folder, or a file where a folder should be
                names = frozenset()
            self._listings[folder] = names
        return name in names or (self.root / relative).is_file()


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
    records: RecordStore
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


def format_key(parse: ParseFile) -> Hashable:
    """Equal for two parsers that read a file the same way (builders bind their options into a new
    ``functools.partial`` per loader, and partials compare by identity)."""
    if isinstance(parse, functools.partial):
        return format_key(parse.func), repr(parse.args), repr(sorted(parse.keywords.items()))
    return parse


class ParsedFiles:
    """What each annotation file parsed to, shared by the loaders of one process.

    The config check and the build hand one of these to their builders, so every file is
    parsed once per process and what the check found is what the build trains on. An
    entry is keyed by how the file was read (format and its options, image root, whether
    image files were checked) and by the file as it is on disk (path, size, modification
    time): a file rewritten in between is parsed again. Image folders are listed once too.
    """

    def __init__(self) -> None:
        self._files: dict[Hashable, tuple[RecordStore, list[BadRecord]]] = {}
        self._image_indexes: dict[Path, ImageFolderIndex] = {}

    def image_index(self, root: Path) -> ImageFolderIndex:
        return self._image_indexes.setdefault(root, ImageFolderIndex(root))

    def get(self, how: Hashable, path: Path,
            parse: Callable[[], tuple[RecordStore, list[BadRecord]]]) -> tuple[RecordStore, list[BadRecord]]:
        """The entry of ``path`` read ``how``; ``parse()`` makes it if there is none for the file as it is now."""
        try:
            stat = path.stat()
        except OSError:
            return parse()  # raises the reader's error naming the file
        key = (how, path.resolve(), stat.st_size, stat.st_mtime_ns)
        if key not in self._files:
            self._files[key] = parse()
        return self._files[key]


class RecordLoader:
    """Reads annotation files with one format's parser and applies one skip policy.

    Args:
        parse: the format (see :data:`ParseFile`).
        skip: kinds of bad record to leave out instead of raising (:data:`ALL_KINDS` for all).
        check_images: check that every record's image file exists (needs an image root).
        parsed_files: where parsed files are kept; share one between loaders (a builder's check and
            build, the config check and the build of a run) so that each file is parsed once.
            Default: this loader's own.
    """

    def __init__(self, parse: ParseFile, *, skip: Collection[str] = (), check_images: bool = True,
                 parsed_files: ParsedFiles | None = None):
        unknown = set(skip) - ALL_KINDS
        if unknown:
            raise ValueError(f"unknown kind(s) of bad record {sorted(unknown)}; known: {sorted(ALL_KINDS)}")
        self.parse, self.skip, self.check_images = parse, frozenset(skip), check_images
        self.parsed_files = ParsedFiles() if parsed_files is None else parsed_files

    def read(self, path: Path, image_root: Path | None) -> tuple[RecordStore, list[BadRecord]]:
        """Every good record of one file and every bad one; file-level problems raise ``ValueError``."""
        path = Path(path)
        check = self.check_images and image_root is not None
        how = (format_key(self.parse), image_root if check else None)
        return self.parsed_files.get(how, path, lambda: self._read(path, image_root if check else None))

    def _read(self, path: Path, image_root: Path | None) -> tuple[RecordStore, list[BadRecord]]:
        images = None if image_root is None else self.parsed_files.image_index(image_root)
        records, bad = RecordStoreWriter(), []
        with collector_paused():
            for item in self.parse(read_json(path), path):
                if isinstance(item, BadRecord):
                    # Without its traceback: the parser's frames in it hold the whole parsed file (GBs for mix665k).
                    bad.append(item.with_traceback(None))
                elif (problem := item.marker_problem()) is not None:  # one rule for every format
                    bad.append(BadRecord(item.where(), problem))
                elif images is not None and (missing := [f for f in item.files if not images.exists(f)]):
                    kind = "video" if missing[0] == item.video else "image"
                    bad.append(BadRecord(item.where(), f"{kind} file {image_root / missing[0]} not found "
                                                       f"(image root {image_root})", BadRecord.MISSING_IMAGE))
                else:
                    records.append(item)
            return records.finish(), bad

    def load(self, paths: Sequence[Path], image_root: Path | None) -> LoadedRecords:
        """The records of ``paths`` in order; raises :class:`BadRecordsError` unless the bad ones may be skipped."""
        records, skipped, fatal = [], [], []
        for path in paths:
            good, bad = self.read(path, image_root)
            records.append(good)
            for b in bad:
                (skipped if b.kind in self.skip else fatal).append(b)
        if fatal:
            raise BadRecordsError(fatal)
        records = RecordStore.concat(records)
        if not records:
            names = ", ".join(str(p) for p in paths)
            raise ValueError(f"{names}: no usable record" + (f" (all {len(skipped)} were skipped as bad)"
                                                             if skipped else " (the file lists none)"))
        return LoadedRecords(records, skipped)
