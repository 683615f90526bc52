"""What the tests and the benchmarks share: tiny run configs (``configs``), real training processes (``processes``,
``forked``) and checks on what a run wrote (``checks``). It lives beside ``tests/`` and ``benchmarks/`` so that
both import it (the repository root is on the path: pytest's ``pythonpath``, the benchmarks' own ``sys.path``)."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
