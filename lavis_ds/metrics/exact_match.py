"""Exact match: the generated text equals one of the references, after light normalisation."""
from __future__ import annotations

from lavis_ds.common import registry as reg
from lavis_ds.metrics.base import Metric


def normalise(text: str) -> str:
    """Case, surrounding spaces, runs of spaces and one final period do not count."""
    return " ".join(text.lower().strip().rstrip(".").split())


@reg.metrics.register("exact_match")
class ExactMatch(Metric):
    """Fraction of samples whose generated text equals (after :func:`normalise`) any of their references."""

    scores = ("exact_match",)

    def compute(self, predictions: list[str], references: list[list[str]]) -> dict[str, float]:
        hits = sum(normalise(p) in {normalise(r) for r in refs} for p, refs in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}
