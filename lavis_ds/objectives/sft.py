"""Next-token SFT, the default objective, under LAVIS's and MiniGPT4Qwen's task names too.

The model's ``forward`` computes the summed cross-entropy of the supervised answer tokens; the loss is that
sum over the supervised tokens of the whole global batch (``run.loss_reduction: tokens``).
"""
from __future__ import annotations

from typing import Any, Literal

import torch

from lavis_ds.common import registry as reg
from lavis_ds.objectives.base import TOKENS, Objective, ObjectiveOutput


@reg.objectives.register("sft")
class NextTokenSft(Objective):
    """Cross-entropy of every assistant answer (and its end-of-turn token), summed over supervised tokens."""

    UNITS = (TOKENS,)

    def __init__(self, on_image_cut: Literal["drop", "refuse"] = "drop") -> None:
        """
        Args:
            on_image_cut: A sample that ``model.max_txt_len`` would cut inside (or before) an image's placeholders:
                ``drop`` leaves it out of its micro-batch (with its images) and counts it in the log; ``refuse``
                stops the run naming it. Drop by default: in a large mix such a sample is a rare long conversation,
                and a run of days should not end on one record; the log says how many (a run that drops many has a
                ``max_txt_len`` too short for its data).
        """
        self.on_image_cut = on_image_cut

    def prepare(self, model: torch.nn.Module, batch: dict[str, Any], pack_to: int | None = None) -> dict[str, Any]:
        # The model scores the batch itself (no "objective" key): its forward's next-token loss.
        if not hasattr(model, "prepare_batch"):
            return batch
        options = {} if pack_to is None else {"pack_to": pack_to}
        # models whose prepare_batch takes on_image_cut (their settings say)
        if getattr(getattr(model, "SETTINGS", None), "CUTS_IMAGE_SAMPLES", False):
            options["on_image_cut"] = self.on_image_cut
        return model.prepare_batch(batch, **options)

    def counted(self, run: Any, model: torch.nn.Module) -> bool:
        """``run.loss_reduction: tokens`` and a model that prepares its batches on the host and counts their
        supervised tokens; else the per-micro-batch mean (``loss_reduction: mean``, or a model that cannot)."""
        from lavis_ds.models.base import BaseModel  # its supervised_tokens says None: "cannot count"

        counts = getattr(type(model), "supervised_tokens", None) not in (None, BaseModel.supervised_tokens)
        return run.loss_reduction == "tokens" and counts and hasattr(model, "prepare_batch")

    def counts(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, int]:
        return {TOKENS: int(model.supervised_tokens(batch))}

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> ObjectiveOutput:
        out = model(batch)
        return ObjectiveOutput({TOKENS: out["loss_sum"]})


# LAVIS's task names whose models train on next-token text (salesforce/LAVIS lavis/tasks, register_task), and
# MiniGPT4Qwen's (Coobiw/MPP-LLaVA): published YAMLs name them in run.task; here each is next-token SFT.
LAVIS_SFT_TASKS = ("image_text_pretrain", "captioning", "vqa", "gqa", "aok_vqa", "vqa_reading_comprehension",
                   "gqa_reading_comprehension", "dialogue", "discrn_qa", "deepspeed_image_text_pretrain")
for _task in LAVIS_SFT_TASKS:
    reg.objectives.register_alias(_task, "sft")

# LAVIS tasks that are not next-token training of a chat model: named, with why, instead of "unknown".
NOT_NEXT_TOKEN_TASKS = {
    "retrieval": "LAVIS's image-text retrieval (contrastive ITC/ITM losses on BLIP models)",
    "multimodal_classification": "LAVIS's classification head training",
    "text-to-image-generation": "LAVIS's BLIP-Diffusion image generation",
    "classification": "MiniGPT4Qwen's classification example task",
}
