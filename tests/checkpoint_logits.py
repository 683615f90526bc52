"""The logits a fixture checkpoint is checked by, computed in one place.

The fixtures made before a refactor of the model classes (``tests/fixtures/blip2_qwen_before/``,
``tests/fixtures/models_before/``) recorded logits with this function, and their tests compare against it with the
code of today. It is the one place that reaches past the model's public calls (``prepare_batch`` and the module
``llm_model``, whose name is the file format's ``llm_model.*`` keys): a refactor that renames how a prepared batch
becomes the LLM's inputs changes this function, and the recorded numbers say whether the result is still the same.
"""
from __future__ import annotations

from typing import Any

import torch


def llm_logits(model: torch.nn.Module, samples: dict[str, Any], last: int) -> torch.Tensor:
    """The LLM's logits (fp32) over the last ``last`` positions of ``samples`` (one batch, prepared here), the
    images' features spliced into their placeholders, in eval mode without gradients."""
    model.eval()
    with torch.no_grad():
        inputs_embeds, layout, _ = model._inputs(model.prepare_batch(samples), None)
        logits = model.llm_model(inputs_embeds=inputs_embeds, **layout).logits.float()
    return logits[:, -last:]
