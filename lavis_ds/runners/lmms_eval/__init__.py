"""lmms-eval evaluates lavis_ds models: the benchmarks people report, on a live model, a checkpoint or an export.

- :mod:`.model`: ``LavisDsLmms``, lmms-eval's model class for a lavis_ds model (``--model lavis_ds``). It is the
  one module that imports lmms-eval; nothing in lavis_ds imports it unless an evaluation is asked for.
- :mod:`.requests`: lmms-eval's requests as lavis_ds batches (prompt markers, images, videos, stop strings).
- :mod:`.scoring`: the log-likelihood of a continuation, computed inside the model's forward.
- :mod:`.tasks`: lmms-eval's tasks checked before a model loads (known names, local datasets on disk).

lmms-eval is the optional extra ``eval`` (``pip install -e ".[eval]"``); :func:`require_lmms_eval` says so in one
line where it is missing.
"""
from __future__ import annotations

from lavis_ds.common.errors import InputError

INSTALL_LINE = 'pip install -e ".[eval]"  (lmms-eval==0.7.3, decord, "filelock<4")'


def require_lmms_eval() -> None:
    """Raise one ``InputError`` naming the install line when lmms-eval cannot be imported."""
    try:
        import lmms_eval.api.model  # noqa: F401
    except ImportError as e:
        raise InputError(f"lmms-eval is not installed here ({e}); install it with: {INSTALL_LINE}") from None
