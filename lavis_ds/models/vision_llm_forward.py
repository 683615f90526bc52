"""What a vision-LLM computes on a batch: the prompts tokenized, the image features spliced into the LLM's input
embeddings at the placeholder tokens, the loss, the answers' log-probabilities and generation.

:class:`VisionLLMForward` is the base of ``lavis_ds.models.vision_llm.VisionLLM``, which builds the parts these
methods run (``llm_model``, ``llm``, ``image_path``, ``images``, ``batch``) and which architectures subclass.
"""
from __future__ import annotations

from typing import Any, Literal

import torch

from lavis_ds.models.base import BaseModel
from lavis_ds.models.chat_llm import ChatLLM
from lavis_ds.models.image_layout import ImageLayout
from lavis_ds.models.image_path import ImagePath
from lavis_ds.models.image_tokens import batch_images, check_feature_rows, per_sample, select_images
from lavis_ds.models.linear_attention import boundary_kwargs
from lavis_ds.models.llm import base_llm
from lavis_ds.models.lm_loss import full_logits_loss, head_loss_supported, token_logps
from lavis_ds.models.prompt import IGNORE_INDEX, image_counts, pad_batch, pad_positions
from lavis_ds.models.vision_llm_batch import HostBatch, packed_image_order, sample_of_positions


class VisionLLMForward(BaseModel):
    """The batch, the splice, the loss and generation of a ``VisionLLM``, whose constructor sets the attributes
    below."""

    PACKS = True  # prepare_batch(samples, pack_to=N) packs samples into rows (lavis_ds.models.packing)
    # prepare_batch(samples, on_image_cut="drop") leaves out the samples truncation would cut into an image
    # (the SFT objective's run.sft.on_image_cut)
    CUTS_IMAGE_SAMPLES = True
    # Set by VisionLLM's constructor (and the model contract's "chat" and "merge" needs, models.base.CONTRACT).
    llm: ChatLLM  # the LLM part: tokenizer, prompt, positions, pad and end-of-turn ids, the LLM's config
    images: ImageLayout  # each image's token count and grid, the blank image (image_layout)
    image_path: ImagePath  # tower -> connector, the batch's features and their splice (image_path)
    batch: HostBatch  # the host side of prepare_batch (vision_llm_batch)
    llm_model: Any  # the transformers causal LM (peft-wrapped with LoRA): llm.model, registered here
    loss_chunks: int

    @property
    def image_size(self) -> int | None:
        """The side of the square images the tower takes (None: each image keeps its own size)."""
        return self.images.image_size

    def _head_at_supervised_positions(self) -> bool:
        """Whether the loss applies the LM head at the supervised positions only (``lavis_ds.models.lm_loss``)."""
        return bool(self.loss_chunks) and head_loss_supported(base_llm(self.llm_model))

    # ----------------------------------------------------------------- the batch
    def prepare_batch(self, samples: dict[str, Any], pack_to: int | None = None,
                      on_image_cut: Literal["drop", "refuse"] = "refuse") -> dict[str, Any]:
        """The samples rendered, tokenized and laid out on the host (``HostBatch.prepare``, the part ``batch``)."""
        return self.batch.prepare(samples, pack_to, on_image_cut)

    def supervised_tokens(self, samples: dict[str, Any]) -> int:
        """The answer tokens (and end-of-turn tokens) the loss of ``forward`` sums over: labels[:, 1:] supervised."""
        return int((samples["labels"][:, 1:] != IGNORE_INDEX).sum())

    # ----------------------------------------------------------------- forward
    def image_features(self, samples: dict[str, Any]) -> torch.Tensor:
        """The flat image features of a prepared batch (packed order under packing; a blank image's when it has
        none), to pass to ``answer_logps`` for several batches that share the images (a preference pair)."""
        image = samples.get("image")
        if image is not None and "position_ids" in samples and batch_images(samples):
            # The image fields in packed order; the per-sample fields stay in sample order (an instruction
            # connector reorders its own rows, ImagePath.encode).
            samples = {**samples, **select_images(samples, packed_image_order(samples).tolist())}
            image = samples["image"]
        return self.image_path.features(image, dummy=True, samples=samples)

    def _inputs(self, samples: dict[str, Any], image_features: torch.Tensor | None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """``(inputs_embeds, layout, labels)`` of a prepared batch on the model's device."""
        image = samples.get("image")
        device = self._device() if image is None else image.device
        input_ids, labels = samples["input_ids"].to(device), samples["labels"].to(device)
        rope = samples.get("rope_position_ids")  # a family's rows beyond 1-D (M-RoPE's three)
        if "position_ids" in samples:  # packed: each sample's images in the order the samples were laid out
            positions = samples["position_ids"]
            # the plain positions in front: the row the text model reads packed sample boundaries from
            layout = {"position_ids": (positions if rope is None else torch.cat([positions[None], rope])).to(device),
                      # what a recurrent layer needs beside the positions (Qwen3.5's Gated-DeltaNet); refused if none
                      **boundary_kwargs(base_llm(self.llm_model), samples.get("row_spans"), device)}
        else:
            layout = {"attention_mask": samples["attention_mask"].to(device)}
            if rope is not None:
                layout["position_ids"] = rope.to(device)
        features = self.image_features(samples) if image_features is None else image_features
        has_images = batch_images(samples) > 0
        if has_images:  # the placeholders prepare_batch reserved, against the rows given (host integers: no sync)
            counts = samples.get("image_tokens") or self.images.counts(samples)
            # Named per sample where the counts are the samples' (a preference pair's sides share the pair's images).
            nums = [int(n) for n in samples.get("num_images") or ()]
            check_feature_rows(features.shape[0], counts, nums if sum(nums) == len(counts) else [len(counts)],
                               "the image features given")
        inputs_embeds, more = self.image_path.splice(input_ids, features if has_images else features[:0])
        layout.update(more)
        if not has_images:
            # The dummy image's features times zero: in the graph, out of the numbers (see ImagePath.features).
            inputs_embeds = inputs_embeds + features.sum() * 0
        return inputs_embeds, layout, labels

    def forward(self, samples: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Mean cross-entropy over the supervised tokens of the micro-batch.

        Returns:
            ``loss`` (fp32 scalar to backpropagate), ``loss_sum`` (the summed token losses, also
            differentiable: the runner divides it by the supervised tokens of the whole step under
            ``run.loss_reduction: tokens``) and ``num_tokens`` (supervised tokens).

            A batch an objective prepared for itself (``samples["objective"]``, e.g. preference pairs) is scored by
            that objective instead (``lavis_ds.objectives``: its loss and metric sums). It runs here, inside the
            root module's forward, so that FSDP2 and ZeRO-3 have gathered the root's own parameters for it.
        """
        objective = samples.get("objective")
        if objective is not None:
            return objective(self, samples).as_dict()
        samples = self.prepare_batch(samples)
        inputs_embeds, layout, labels = self._inputs(samples, None)
        if self._head_at_supervised_positions():
            token_losses = -token_logps(self.llm_model, inputs_embeds, layout, labels, self.loss_chunks,
                                        samples.get("supervised_positions"))[0].sum()
        else:
            token_losses = full_logits_loss(self.llm_model, inputs_embeds, layout, labels,
                                            samples.get("supervised_positions"))
        num_tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        # A batch whose answers were all truncated away gives loss 0 (and zero gradients), not NaN.
        loss = token_losses / num_tokens.clamp(min=1)
        return {"loss": loss, "loss_sum": token_losses, "num_tokens": num_tokens}

    def answer_logps(self, samples: dict[str, Any], image_features: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample: the summed log-probability (fp32) of its supervised tokens, and how many there are.

        Args:
            samples: A batch, prepared (``prepare_batch``, padded or packed) or not.
            image_features: ``image_features(samples)`` computed already (a preference pair's chosen and rejected
                answers share their images: one vision pass for both); None computes them.

        Returns:
            ``(logp_sum [B], num_tokens [B])`` in sample order (the order of ``samples["instruction"]``).
        """
        samples = self.prepare_batch(samples)
        inputs_embeds, layout, labels = self._inputs(samples, image_features)
        logps, positions = token_logps(self.llm_model, inputs_embeds, layout, labels, self.loss_chunks,
                                       samples.get("supervised_positions"))
        owner, num_samples = sample_of_positions(samples, positions, labels)
        logp_sum = torch.zeros(num_samples, dtype=logps.dtype, device=logps.device).index_add(0, owner, logps)
        counts = torch.zeros(num_samples, dtype=torch.long, device=logps.device).index_add(
            0, owner, torch.ones_like(owner))
        return logp_sum, counts

    @torch.no_grad()
    def generate(self, samples: dict[str, Any], num_beams: int = 1, max_new_tokens: int = 30,
                 synced_gpus: bool = False, **generate_kwargs: Any) -> list[str]:
        """Answer the last instruction of each sample (greedy or beam search).

        ``samples``: ``image`` (every sample's images in order, ``[N, 3, H, W]``; may be
        empty or left out for text-only samples), ``instruction`` (turns per sample),
        optionally ``output`` (the answers of the earlier turns) and ``num_images`` (images
        per sample, default 1 each; each image has its ``<ImageHere>`` marker in the
        sample's turns, one image may go unmarked) and ``system`` (each sample's own system turn, None: the
        model's ``system_prompt``). ``synced_gpus`` must be true under
        ZeRO-3 with more than one rank, so that every rank keeps stepping until all have finished.
        Other keyword arguments go to the LLM's ``generate`` (sampling settings, a ``streamer``).
        """
        image = samples.get("image")
        answers = samples.get("output") or [()] * len(samples["instruction"])
        systems = samples.get("system") or [None] * len(samples["instruction"])
        num_images = image_counts(samples)
        counts = per_sample(self.images.counts(samples), num_images)
        videos = per_sample(self.llm.prompt.video_marks(samples), num_images)
        prompt = self.llm.prompt
        prompts = [prompt.generation_prompt(ins, out, len(mine), image_tokens=mine, system=system, videos=video)
                   for ins, out, mine, system, video in zip(samples["instruction"], answers, counts, systems, videos,
                                                            strict=True)]
        input_ids, attention_mask = pad_batch(prompts, self.llm.pad_id, side="left")
        device = self._device() if image is None else image.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

        # Parameters of this root module (query tokens, ...): an engine that shards them gathers them for generate
        # (which is not forward) itself. Sharded ranks run the towers even without an image (ImagePath.features).
        image_embeds = self.image_path.features(image, dummy=synced_gpus, samples=samples)
        inputs_embeds, more = self.image_path.splice(input_ids, image_embeds if sum(num_images) else image_embeds[:0])
        # The placeholders are never words: generating one would feed its meaningless row back in.
        options = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=self.llm.stop_token_ids(), pad_token_id=self.llm.pad_id, synced_gpus=synced_gpus,
                       suppress_tokens=self.llm.prompt.placeholder_ids)
        options.update(more)
        options.update(generate_kwargs)
        rope = self.batch.rope_positions(prompts, samples)
        if rope is not None:
            # The prompt's M-RoPE ids; generate continues each row at its last id + 1, which is a new token's plain
            # position plus its sample's rope delta (what transformers' Qwen2-VL keeps as rope_deltas).
            options["position_ids"] = pad_positions(rope, input_ids.shape[1], side="left").to(device)
        # With only inputs_embeds, generate returns just the new tokens.
        new_tokens = self.llm_model.generate(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **options)
        return [text.strip() for text in self.llm.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def _device(self) -> torch.device:
        return self.llm_model.get_input_embeddings().weight.device
