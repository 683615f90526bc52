"""Qwen3.5 (``qwen3_5``): Qwen3-VL's image path without DeepStack under Qwen3.5's hybrid language model.

transformers' ``Qwen3_5ForConditionalGeneration`` is Qwen3-VL's tower (16 px patches, the learned position table,
``model.visual.merger``) with no DeepStack taps or mergers, and Qwen3.5's text model (``qwen3_5_text``: three
Gated-DeltaNet layers before each attention layer, a 248,320-token vocabulary). lavis_ds composes the same parts:
the ``qwen3_vl`` tower with ``deepstack_visual_indexes: []``, ``qwen3_vl_merger`` with ``deepstack_taps: 0``, and
``qwen3_5_text`` in the LLM slot (``models.linear_attention``: its Gated-DeltaNet layers start afresh at each packed
sample). Positions come from the M-RoPE provider as for Qwen3-VL: an image's tokens are numbered over its grid of
merged tokens (``get_rope_index`` of transformers' ``Qwen3_5Model`` numbers them alike), three rows when padded and
four when packed (the plain positions in front, from which the attention layers read the sample boundaries); the
text model interleaves the rows' frequencies over its rotary quarter of each head (``mrope_section`` [11, 11, 10]:
the 32 frequencies of 64 rotary dimensions in the published models).

Published folders load with ``load_pretrained`` and export with ``--format hf`` (``lavis_ds.models.hf.qwen3_5``).
Videos take Qwen3-VL's layout (``models.qwen3_vl``: each frame group after its timestamp text).
"""
from __future__ import annotations

from lavis_ds.common import registry as reg
from lavis_ds.models.qwen3_vl import Qwen3VL
from lavis_ds.models.settings.qwen3_vl import Qwen35Settings


@reg.models.register("qwen3_5")
class Qwen35(Qwen3VL):
    """Qwen3.5: the ``qwen3_vl`` tower without DeepStack taps, ``qwen3_vl_merger`` without DeepStack mergers,
    Qwen3.5's hybrid text model."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "9b": "models/qwen3_5/9b.yaml",
        "tiny": "models/qwen3_5/tiny.yaml",
    }
    SETTINGS = Qwen35Settings
