"""Reading checkpoint and weights files without running the code a crafted file carries.

A ``.pt``/``.pth``/``.bin`` file is a pickle, and unpickling calls whatever functions the file names: a file a user
downloads or is handed (a colleague's run folder, a published checkpoint) could run anything the moment it is
read. Every such file lavis_ds reads goes through torch's restricted unpickler (``weights_only=True``), which builds
tensors and plain containers and nothing else, plus the few classes a checkpoint legitimately holds, allowed by
name (numpy's, for the RNG states; each engine adds its own). A library that reads a checkpoint on lavis_ds's
behalf and asks torch for an unrestricted load (DeepSpeed's loaders, DCP's non-tensor entries) runs inside
:func:`library_reads`, which makes torch ignore that request. A raw pickle that is not a torch file (DCP's
index) is read by :func:`load_pickle` with an explicit list of the classes it may build.

A refused file is an :class:`UnsafeFile` naming the file and the global it asked for; it is never a "damaged"
checkpoint, so ``run.resume: auto`` stops on it instead of quietly taking an older one.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from lavis_ds.common.errors import CheckpointError

# What np.random.get_state() pickles into (the RNG states of every checkpoint). numpy 2 names its array
# reconstructor numpy._core.multiarray._reconstruct, numpy 1 numpy.core...: either name, whichever numpy wrote it.
_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(0))[0]
RNG_CLASSES = ((_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
               (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, type(np.dtype(np.uint32)))

# torch reads this variable at every torch.load: set, weights_only is True whatever the caller passed.
_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses both set at once
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeFile(CheckpointError):
    """A file asks to build a Python object that a checkpoint never holds; reading it on would run its code."""


def torch_load(path: str | os.PathLike, allowed: Iterable = (), mmap: bool = False, **kwargs) -> Any:
    """``torch.load(path, weights_only=True)`` with numpy's RNG classes and ``allowed`` allowed by name; an
    :class:`UnsafeFile` naming the file and the global if it asks for anything else. ``mmap`` applies to zip-format
    files only (the only ones torch can map); other errors are torch's."""
    path = Path(path)
    try:
        with _allowing(allowed):
            return torch.load(path, weights_only=True, mmap=mmap and zipfile.is_zipfile(path), **kwargs)
    except pickle.UnpicklingError as e:
        refused = refusal(path, e, allowed)
        if refused is None:
            raise
        raise refused from None


@contextlib.contextmanager
def library_reads(source: str | os.PathLike, allowed: Iterable = ()) -> Iterator[None]:
    """Every ``torch.load`` inside, whoever calls it and with whatever ``weights_only``, is restricted as
    :func:`torch_load` is: for a library's own loader (DeepSpeed's, DCP's) that asks for an unrestricted load.
    A refusal inside is an :class:`UnsafeFile` naming ``source`` (the folder handed to the library).

    torch's switch for this is an environment variable: process-wide while the block runs, restored after.
    """
    saved = {name: os.environ.get(name) for name in (_FORCE, _FORCE_NOT)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_FORCE_NOT, None)
    try:
        with _allowing(allowed):
            yield
    except pickle.UnpicklingError as e:
        refused = refusal(Path(source), e, allowed)
        if refused is None:
            raise
        raise refused from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _allowing(allowed: Iterable):
    """torch's safe_globals for numpy's RNG classes and ``allowed``, adding (and removing on exit) only those not
    allowed already: an enclosing block's list stays whole when this one ends."""
    present = set(torch.serialization.get_safe_globals())
    return torch.serialization.safe_globals([entry for entry in (*RNG_CLASSES, *allowed) if entry not in present])


def load_pickle(path: str | os.PathLike, allowed: Callable[[str, str], Any]) -> Any:
    """A raw pickle (not a torch file) that may build only what ``allowed(module, name)`` returns (None: refused,
    an :class:`UnsafeFile` naming the file and the global)."""
    path = Path(path)

    class OnlyAllowed(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allowed(module, name)
            if found is None:
                raise UnsafeFile(_message(path, [f"{module}.{name}"]))
            return found

    with open(path, "rb") as file:
        return OnlyAllowed(file).load()


def refusal(path: Path, error: pickle.UnpicklingError, allowed: Iterable = ()) -> UnsafeFile | None:
    """The :class:`UnsafeFile` for torch's weights_only refusal of ``path`` (a file, or a folder a library read),
    naming every global the file asks for, not only the first torch stopped at; None if the error is no refused
    global (a damaged pickle)."""
    names = _REFUSED_GLOBAL.findall(str(error))
    if path.is_dir():  # a library read some file in it: name the torch file that asks for globals, where one does
        for file in sorted(path.rglob("*")):
            found = _unsafe_globals(file, allowed) if file.is_file() and zipfile.is_zipfile(file) else []
            if found:
                return UnsafeFile(_message(file, found))
    elif path.is_file():  # torch may stop before naming a global (a raw pickle of protocol 4 or later)
        names = _unsafe_globals(path, allowed) or names
    return UnsafeFile(_message(path, names)) if names else None


def pickle_in_place_of(path: Path, expected: str) -> UnsafeFile | None:
    """The :class:`UnsafeFile` for a pickle (a torch file or a raw pickle) found where a file of the ``expected``
    format (one that cannot carry code) should be, if it asks for globals that weights_only refuses; None
    otherwise. Nothing of it runs: its opcodes are only read."""
    names = _unsafe_globals(Path(path), ())
    return UnsafeFile(_message(Path(path), names, f"; and a {expected} file holds no pickle at all")) if names else None


def _message(path: Path, names: list[str], note: str = "") -> str:
    return (f"{path}: refused: it asks to build {', '.join(dict.fromkeys(names))}, which no checkpoint of tensors "
            f"holds, and unpickling it would run whatever code that names{note}. lavis_ds reads checkpoint and "
            "weights files with torch.load(weights_only=True), allowing only the classes docs/checkpoints.md lists "
            "(\"Which files are trusted\"). Do not use this file unless you trust its source; if you do and it is "
            "refused, report it as a lavis_ds bug")


def _unsafe_globals(path: Path, allowed: Iterable) -> list[str]:
    """The globals a torch file (zip format) or a raw pickle names that weights_only does not allow, read from its
    opcodes without running it; empty for a file that is neither (or is damaged)."""
    if zipfile.is_zipfile(path):
        try:
            with _allowing(allowed):
                return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 - the names are for the message only (a zip that is no torch file: none)
            return []
    from torch import _weights_only_unpickler  # torch's own default list; only messages depend on it

    known = set(_weights_only_unpickler._get_allowed_globals()) | {
        entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"
        for entry in (*RNG_CLASSES, *allowed)}
    return [name for name in _globals_in_pickle(path.read_bytes()) if name not in known]


def _globals_in_pickle(data: bytes) -> list[str]:
    """The ``module.name`` of every GLOBAL/STACK_GLOBAL opcode of a pickle, from its opcodes alone (nothing runs)."""
    found, strings, memo, last = [], [], {}, None
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name == "GLOBAL":
                found.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            elif op.name == "MEMOIZE":
                memo[len(memo)] = last
            elif op.name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = last
            elif op.name in ("BINGET", "LONG_BINGET") and isinstance(memo.get(arg), str):
                strings.append(memo[arg])
            last = arg if isinstance(arg, str) and "UNICODE" in op.name else None
            if last is not None:
                strings.append(last)
    except Exception:  # noqa: BLE001 - a damaged pickle: what was read so far
        pass
    return found
