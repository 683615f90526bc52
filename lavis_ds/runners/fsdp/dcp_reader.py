"""Reading a ``torch.distributed.checkpoint`` folder without running the code a crafted one carries.

DCP unpickles its index (``.metadata``) with plain ``pickle.load``, and its non-tensor entries (the optimizer's
hyper-parameters) with an unrestricted ``torch.load``: either would run whatever a crafted file names. Here the
index is read by :class:`SafeIndexReader`, whose unpickler builds DCP's own metadata classes and nothing else, and
every entry inside ``safe_files.library_reads`` (torch's restricted unpickler, whatever DCP asks for).
"""
from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from lavis_ds.common import safe_files

# What DCP's index pickles (its metadata dataclasses, torch sizes, dtypes and layouts, the checkpoint's path),
# by module. Names, not modules: a module's other attributes (the `os` it imports) are no index content.
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorProperties", "BytesStorageMetadata",
                                              "TensorStorageMetadata", "ChunkStorageMetadata", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "PureWindowsPath"},  # their module from Python 3.13 on
    "collections": {"OrderedDict"},
}


def index_class(module: str, name: str) -> Any:
    """The class (or function) a DCP index may build for ``module.name``; None for anything else."""
    if name in _INDEX_CLASSES.get(module, ()):
        return getattr(importlib.import_module(module), name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return None


class SafeIndexReader(FileSystemReader):
    """DCP's file-system reader, except that the index is unpickled with :func:`index_class` as its only globals."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = safe_files.load_pickle(Path(self._get_metadata_path(kwargs.get("rank"))), index_class)
        # As FileSystemReader.read_metadata finishes: a load id for this read.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_index(tag_dir: Path):
    """The DCP index of ``tag_dir``, read without running code (an UnsafeFile if it asks for anything else)."""
    return SafeIndexReader(str(tag_dir)).read_metadata()


def load(state: dict, tag_dir: Path, no_dist: bool = False) -> None:
    """``dcp.load(state)`` from ``tag_dir`` (in place), reading no file in a way that could run code. A refused file
    is the UnsafeFile itself, not DCP's wrapper around every rank's error."""
    try:
        with safe_files.library_reads(tag_dir):
            dcp.load(state, storage_reader=SafeIndexReader(str(tag_dir)), no_dist=no_dist)
    except dcp.api.CheckpointException as e:
        for error in _failures(e):
            if isinstance(error, safe_files.UnsafeFile):  # the index
                raise error from None
            refused = safe_files.refusal(Path(tag_dir), error) if isinstance(error, pickle.UnpicklingError) else None
            if refused is not None:  # a non-tensor entry, which DCP keeps at an offset of a .distcp file
                raise refused from None
        raise


def _failures(error: dcp.api.CheckpointException) -> list[BaseException]:
    """Each failing rank's error inside DCP's wrapper, lowest rank first."""
    found = []
    for _, failure in sorted((getattr(error, "failures", None) or {}).items()):
        found.append(failure[0] if isinstance(failure, tuple) else failure)
    return found
