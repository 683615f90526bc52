"""What a metric is: generated texts and their references in, named scores out.

A metric is registered by name (``@reg.metrics.register("caption")``) and
named in the YAML (``run.test_metrics: [caption, exact_match]``). It scores a
whole split at once - CIDEr's document frequencies are corpus statistics - and
every sample brings *all* its references (COCO's five captions, VQAv2's ten
answers), never one sample per reference.
"""
from __future__ import annotations

from typing import ClassVar, Sequence


class Metric:
    """Base class: ``metric(predictions, references) -> {score name: value}``.

    Subclasses set ``higher_is_better`` (used by ``run.best_metric``) and
    implement :meth:`compute`. A metric with one score names it after itself
    (``{"exact_match": 0.93}``); one with several names each (``{"CIDEr": ...}``).
    """

    higher_is_better: ClassVar[bool] = True
    scores: ClassVar[tuple[str, ...]] = ()  # the keys compute() returns

    def __call__(self, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
        check_inputs(predictions, references)
        return self.compute(list(predictions), [list(r) for r in references]) if predictions else {}

    def compute(self, predictions: list[str], references: list[list[str]]) -> dict[str, float]:
        raise NotImplementedError


def check_inputs(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    """One list of at least one reference string per prediction string; ValueError saying which sample is off."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} prediction(s) but {len(references)} reference list(s); "
                         "give one list of references per prediction")
    for i, (prediction, refs) in enumerate(zip(predictions, references)):
        if not isinstance(prediction, str):
            raise ValueError(f"sample {i}: the prediction must be a string, got {prediction!r}")
        if isinstance(refs, str) or not refs or not all(isinstance(r, str) for r in refs):
            raise ValueError(f"sample {i}: references must be a non-empty list of strings, got {refs!r}")
