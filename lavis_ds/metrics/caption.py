"""BLEU-1..4 and CIDEr as the COCO caption evaluation computes them.

The scorers are pycocoevalcap's own ``Bleu(4)`` and ``Cider()`` (the package
LAVIS and the COCO caption server use), fed exactly as its ``COCOEvalCap``
feeds them: every caption - generated and reference - tokenised and stripped of
punctuation first. pycocoevalcap does that with Stanford's Java PTBTokenizer;
:mod:`lavis_ds.metrics.ptb_tokenizer` does the same in Python, so evaluation
needs no Java (and equals the Java-tokenised numbers on the checked cases).
"""
from __future__ import annotations

import contextlib
import io

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider

from lavis_ds.common import registry as reg
from lavis_ds.metrics.base import Metric
from lavis_ds.metrics.ptb_tokenizer import tokenize_caption


@reg.metrics.register("caption")
class CaptionMetrics(Metric):
    """``Bleu_1`` ... ``Bleu_4`` and ``CIDEr`` (pycocoevalcap's CIDEr-D: the "CIDEr" of COCO and LAVIS reports)."""

    scores = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "CIDEr")

    def compute(self, predictions: list[str], references: list[list[str]]) -> dict[str, float]:
        # Keyed by sample number, as COCOEvalCap keys by image id: one hypothesis, all references.
        res = {i: [tokenize_caption(p)] for i, p in enumerate(predictions)}
        gts = {i: [tokenize_caption(r) for r in refs] for i, refs in enumerate(references)}
        with contextlib.redirect_stdout(io.StringIO()):  # Bleu prints its n-gram counts
            bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        cider, _ = Cider().compute_score(gts, res)
        return {**{f"Bleu_{n}": float(b) for n, b in enumerate(bleu, start=1)}, "CIDEr": float(cider)}
