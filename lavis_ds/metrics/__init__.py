"""Evaluation metrics, registered by name (importing this registers them).

``run.test_metrics`` / ``run.val_metrics`` (or a dataset section's ``metrics``) name them;
:func:`build_metric` looks one up. See :mod:`lavis_ds.metrics.base` for the interface.
"""
from lavis_ds.common import registry as reg
from lavis_ds.metrics.base import Metric
from lavis_ds.metrics.caption import CaptionMetrics
from lavis_ds.metrics.exact_match import ExactMatch
from lavis_ds.metrics.ptb_tokenizer import ptb_tokenize, tokenize_caption
from lavis_ds.metrics.vqa import VqaAccuracy, normalise_answer, vqa_accuracy


def build_metric(name: str) -> Metric:
    """The registered metric ``name``; an unknown name raises a KeyError listing the known ones."""
    return reg.metrics.get(name)()


__all__ = ["Metric", "ExactMatch", "CaptionMetrics", "VqaAccuracy", "build_metric", "ptb_tokenize",
           "tokenize_caption", "normalise_answer", "vqa_accuracy"]
