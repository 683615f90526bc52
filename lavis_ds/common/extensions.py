"""Where torch JIT-compiles C++ extensions (DeepSpeed's CPU ops among them): one place per environment.

By default torch keeps compiled extensions in ``~/.cache/torch_extensions``, shared by every
Python environment, and builds with whichever ``ninja`` comes first on PATH. The system's ninja
and the one pip installs write different build logs, so switching between them (a PATH with
or without the venv's ``bin``, e.g. ``torchrun`` one time and an activated venv the next) or
sharing the folder between environments silently rebuilds everything: minutes that look like
a hang. Every environment gets its own folder and always the ninja installed with lavis_ds.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def configure_build_environment() -> Path:
    """Default ``TORCH_EXTENSIONS_DIR`` to ``<sys.prefix>/torch_extensions``; put pip's ninja first. Idempotent."""
    folder = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
    try:
        import ninja  # the PyPI package, a dependency of lavis_ds
    except ImportError:  # only a system ninja: consistent as long as it is the only one
        return folder
    ninja_bin = str(Path(ninja.BIN_DIR))
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != ninja_bin]
    os.environ["PATH"] = os.pathsep.join([ninja_bin, *path])
    return folder
