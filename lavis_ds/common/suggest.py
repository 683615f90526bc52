"""The one "did you mean" of lavis_ds: every registry, config section, preset and setting suggests the closest
valid name through it, so a typo reads the same wherever it is made."""
from __future__ import annotations

import difflib
from typing import Iterable


def closest(name: object, candidates: Iterable[str], n: int = 1) -> list[str]:
    """Up to ``n`` of ``candidates`` most like ``name``, best first (difflib's ratio >= 0.6); [] if none is close."""
    return difflib.get_close_matches(str(name), [str(c) for c in candidates], n=n)


def did_you_mean(name: object, candidates: Iterable[str], otherwise: str = "", n: int = 1,
                 sentence: bool = False) -> str:
    """``did you mean 'x'?`` (``'x', 'y'`` with ``n`` > 1) for the candidates closest to ``name``, else
    ``otherwise`` (e.g. the list of valid names). ``sentence``: ``Did you mean ...`` to start a sentence."""
    close = closest(name, candidates, n)
    if not close:
        return otherwise
    return f"{'Did' if sentence else 'did'} you mean {', '.join(repr(c) for c in close)}?"
