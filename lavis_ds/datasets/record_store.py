"""Records packed into one byte buffer per annotation file, decoded to an :class:`InstructionRecord` on access.

Why not a list of records: DataLoader workers are forked, and every Python object
a worker reads gets its reference count (and, at a full garbage collection, its GC
header) written, so the worker copies the memory page it lives on. A list of
665k record objects (LLaVA's mix665k) is copied into every worker as an epoch
reads it, about 1.5 GB per worker (PyTorch issue 13246). Here one file's records
are two NumPy arrays - a byte buffer holding each record pickled, and the offsets
where each record starts - plus the file's path: reading a record writes to
neither array's memory, so workers share it with the main process for good.
Pickling a store (a ``spawn`` worker, a copy) writes two arrays, never one
object per record.

Pickle is the record encoding because it round-trips every field exactly (tuples,
ids that are ints or strings) at C speed; the bytes never leave the process that
wrote them, so nothing untrusted is ever unpickled.
"""
from __future__ import annotations

import bisect
import pickle
from array import array
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from lavis_ds.datasets.records import InstructionRecord, PairRecord


class _Packed(NamedTuple):
    """One file's records: record ``i`` is ``buffer[offsets[i]:offsets[i + 1]]``."""

    buffer: np.ndarray  # uint8
    offsets: np.ndarray  # int64, one more than the records
    sources: tuple[Path, ...]  # the annotation files the records name (usually one)


class RecordStore(Sequence[InstructionRecord]):
    """An immutable sequence of records held in packed buffers (see the module docstring).

    Build one with :class:`RecordStoreWriter`; join several with :meth:`concat`
    (the buffers are shared, not copied).
    """

    def __init__(self, parts: Iterable[_Packed] = ()):
        self._parts = tuple(p for p in parts if len(p.offsets) > 1)
        self._ends = []  # records before the end of each part, for bisect
        for part in self._parts:
            self._ends.append((self._ends[-1] if self._ends else 0) + len(part.offsets) - 1)

    @classmethod
    def concat(cls, stores: Iterable[RecordStore]) -> RecordStore:
        return cls(part for store in stores for part in store._parts)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"record {index} out of range ({n} records)")
        index = int(index) % n
        p = bisect.bisect_right(self._ends, index) if len(self._parts) > 1 else 0
        part = self._parts[p]
        local = index - (self._ends[p - 1] if p else 0)
        start, end = int(part.offsets[local]), int(part.offsets[local + 1])
        source, position, images, instructions, outputs, record_id, list_name, references, video, system, *pair = \
            pickle.loads(memoryview(part.buffer)[start:end])
        cls, more = (PairRecord, {"rejected": pair[0]}) if pair else (InstructionRecord, {})
        return cls(images, instructions, outputs, part.sources[source], position, record_id=record_id,
                   list_name=list_name, references=references, video=video, system=system, **more)

    def __iter__(self) -> Iterator[InstructionRecord]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        """Memory the records take (buffers and offsets)."""
        return sum(p.buffer.nbytes + p.offsets.nbytes for p in self._parts)

    def __repr__(self) -> str:
        return f"RecordStore({len(self)} records, {self.nbytes / 2**20:.1f} MiB)"


class RecordStoreWriter:
    """Packs records one at a time, so a file's records never exist as a list of objects."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._offsets = array("q", [0])
        self._sources: dict[Path, int] = {}

    def append(self, record: InstructionRecord) -> None:
        source = self._sources.setdefault(record.source, len(self._sources))
        self._buffer += pickle.dumps(
            (source, record.position, tuple(record.images), tuple(record.instructions), tuple(record.outputs),
             record.record_id, record.list_name, None if record.references is None else tuple(record.references),
             record.video, record.system, *((record.rejected,) if isinstance(record, PairRecord) else ())),
            protocol=pickle.HIGHEST_PROTOCOL)
        self._offsets.append(len(self._buffer))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def finish(self) -> RecordStore:
        """The store of every appended record; the writer is empty afterwards."""
        part = _Packed(np.frombuffer(self._buffer, dtype=np.uint8) if self._buffer else np.zeros(0, np.uint8),
                       np.frombuffer(self._offsets, dtype=np.int64).copy(), tuple(self._sources))
        self.__init__()
        return RecordStore([part])


def pack(records: Iterable[InstructionRecord]) -> RecordStore:
    """``records`` as a store (for records made in code; loaders write theirs as they parse)."""
    writer = RecordStoreWriter()
    for record in records:
        writer.append(record)
    return writer.finish()
