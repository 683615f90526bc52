"""What a vision-LLM computes on a batch: the prompts tokenized, the image features spliced into the LLM's input
embeddings at the placeholder tokens, the loss, the answers' log-probabilities and generation.

:class:`VisionLLMForward` is the base of ``lavis_ds.models.vision_llm.VisionLLM``, which builds the parts these
methods run (``llm_model``, ``prompt``, ...) and which architectures subclass; they give the image path
(``encode_images``) and may add host-side batch fields (``batch_fields``).
"""
from __future__ import annotations

from typing import Any

import torch

from lavis_ds.models.base import BaseModel
from lavis_ds.models.llm import base_llm
from lavis_ds.models.lm_loss import full_logits_loss, head_loss_supported, token_logps
from lavis_ds.models.prompt import IGNORE_INDEX, ChatPrompt, image_counts, pad_batch
from lavis_ds.models.vision_llm_batch import packed_image_order, sample_of_positions, token_batch


class VisionLLMForward(BaseModel):
    """The batch, the splice, the loss and generation of a ``VisionLLM``, whose constructor sets the attributes
    below."""

    PACKS = True  # prepare_batch(samples, pack_to=N) packs samples into rows (lavis_ds.models.packing)
    # Keys ``batch_fields`` adds that hold one row per image, in image order (e.g. an instruction connector's BERT
    # tokens): a batch whose samples share images (a preference pair's two sides) keeps one row per distinct image.
    PER_IMAGE_FIELDS: tuple[str, ...] = ()
    # Set by VisionLLM's constructor (and the model contract's "chat" and "merge" needs, models.base.CONTRACT).
    tokens_per_image: int
    image_size: int
    llm_tokenizer: Any  # a transformers tokenizer, the prompt's tokens added
    prompt: ChatPrompt
    pad_id: int
    end_of_turn_id: int
    llm_model: Any  # the transformers causal LM (peft-wrapped with LoRA)
    loss_chunks: int
    llm_config: Any  # the LLM's transformers config (a VisionLLM property)

    def _head_at_supervised_positions(self) -> bool:
        """Whether the loss applies the LM head at the supervised positions only (``lavis_ds.models.lm_loss``)."""
        return bool(self.loss_chunks) and head_loss_supported(base_llm(self.llm_model))

    def stop_token_ids(self) -> list[int]:
        """Where generation stops: a turn ends with the template's end-of-turn token (<|im_end|>, <|eot_id|>, ...);
        a base model's tokenizer may name another eos (<|endoftext|>): stop at either."""
        eos = self.llm_tokenizer.eos_token_id
        return list(dict.fromkeys(t for t in (self.end_of_turn_id, eos) if t is not None))

    # ----------------------------------------------------------------- the batch
    def batch_fields(self, samples: dict[str, Any]) -> dict[str, Any]:
        """More host-side fields the image path needs (e.g. InstructBLIP's ``qformer_input_ids``), one entry per
        sample in sample order, computed by ``prepare_batch`` on the host. Default: none."""
        return {}

    def prepare_batch(self, samples: dict[str, Any], pack_to: int | None = None) -> dict[str, Any]:
        """The prompts rendered and tokenized on the host: ``input_ids``, ``attention_mask``, ``labels`` added
        (and ``batch_fields``). A batch that has ``labels`` is already prepared and returned as given.

        ``pack_to``: lay the samples end to end in rows of at most that many tokens instead of padding each
        (``position_ids``, per-sample lengths and the packed ``order`` added; see ``models.packing``)."""
        if "labels" in samples:
            return samples
        extra = self.batch_fields(samples)
        return {**samples, **extra, **token_batch(self.prompt, samples, self.pad_id, pack_to)}

    def supervised_tokens(self, samples: dict[str, Any]) -> int:
        """The answer tokens (and end-of-turn tokens) the loss of ``forward`` sums over: labels[:, 1:] supervised."""
        return int((samples["labels"][:, 1:] != IGNORE_INDEX).sum())

    # ----------------------------------------------------------------- forward
    def image_embeds(self, image: torch.Tensor | None, dummy: bool, samples: dict[str, Any] | None = None
                     ) -> torch.Tensor:
        """Features of every image of a batch, ``[N, tokens_per_image, llm_hidden]`` in the LLM embedding dtype
        (``image`` is the flat ``[N, 3, H, W]`` of all samples' images in order; the tower runs once on it).

        A batch with no image (text-only samples only) gives ``[0, ...]``, or with ``dummy`` the features of
        one blank image, which the caller adds to its embeddings times zero (``forward``). Why run the towers
        for nothing: ZeRO-3 and FSDP gather a module's parameters when it runs, as a collective, so every rank
        must run the same modules in each forward or the ranks wait for each other forever; and the trainable
        parts (projection, queries) then get a gradient - zero - on every rank, as the engines' gradient
        reduction expects. Skipping the towers only where no rank has an image would need a collective per
        micro-batch; the blank image costs one image's tower pass, only in image-free micro-batches.
        """
        samples = samples if samples is not None else {}
        dtype = self._embedding_dtype()
        if image is not None and image.shape[0]:
            return self.encode_images(image, samples).to(dtype)
        device = self._device() if image is None else image.device
        if not dummy:
            return torch.zeros((0, self.tokens_per_image, self.llm_config.hidden_size), device=device, dtype=dtype)
        blank = torch.zeros((1, 3, self.image_size, self.image_size), device=device)
        return self.encode_images(blank, samples).to(dtype)

    def encode_images(self, images: torch.Tensor, samples: dict[str, Any]) -> torch.Tensor:
        """``images [N, 3, H, W]`` -> ``[N, tokens_per_image, llm_hidden]``: the architecture's image path."""
        raise NotImplementedError(f"{type(self).__name__} must define encode_images")

    def image_features(self, samples: dict[str, Any]) -> torch.Tensor:
        """The image features of a prepared batch (packed order under packing; a blank image's when it has none),
        to pass to ``answer_logps`` for several batches that share the images (a preference pair)."""
        image = samples.get("image")
        if image is not None and "position_ids" in samples:
            image = image[packed_image_order(samples).to(image.device)]
        return self.image_embeds(image, dummy=True, samples=samples)

    def _inputs(self, samples: dict[str, Any], image_features: torch.Tensor | None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """``(inputs_embeds, layout, labels)`` of a prepared batch on the model's device."""
        image = samples.get("image")
        device = self._device() if image is None else image.device
        input_ids, labels = samples["input_ids"].to(device), samples["labels"].to(device)
        if "position_ids" in samples:  # packed: each sample's images in the order the samples were laid out
            layout = {"position_ids": samples["position_ids"].to(device)}
        else:
            layout = {"attention_mask": samples["attention_mask"].to(device)}
        features = self.image_features(samples) if image_features is None else image_features
        has_images = image is not None and image.shape[0] > 0
        inputs_embeds = self._embed(input_ids, features if has_images else features[:0])
        if not has_images:
            # The dummy image's features times zero: in the graph, out of the numbers (see image_embeds).
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
            token_losses = -token_logps(self.llm_model, inputs_embeds, layout, labels, self.loss_chunks)[0].sum()
        else:
            token_losses = full_logits_loss(self.llm_model, inputs_embeds, layout, labels)
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
        logps, rows = token_logps(self.llm_model, inputs_embeds, layout, labels, self.loss_chunks)
        owner, num_samples = sample_of_positions(samples, rows, labels)
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
        prompts = [self.prompt.generation_prompt(ins, out, n, system)
                   for ins, out, n, system in zip(samples["instruction"], answers, num_images, systems, strict=True)]
        input_ids, attention_mask = pad_batch(prompts, self.pad_id, side="left")
        device = self._device() if image is None else image.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

        # Parameters of this root module (query tokens, ...): an engine that shards them gathers them for generate
        # (which is not forward) itself. Sharded ranks run the towers even without an image (image_embeds).
        image_embeds = self.image_embeds(image, dummy=synced_gpus, samples=samples)
        inputs_embeds = self._embed(input_ids, image_embeds if sum(num_images) else image_embeds[:0])
        # The placeholder is never a word: generating it would feed its meaningless row back in.
        options = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=self.stop_token_ids(), pad_token_id=self.pad_id, synced_gpus=synced_gpus,
                       suppress_tokens=[self.prompt.image_token_id])
        options.update(generate_kwargs)
        # With only inputs_embeds, generate returns just the new tokens.
        new_tokens = self.llm_model.generate(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **options)
        return [text.strip() for text in self.llm_tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def _embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings with each placeholder run replaced by its image's features."""
        embeds = self.llm_model.get_input_embeddings()(input_ids)
        is_image = (input_ids == self.prompt.image_token_id).unsqueeze(-1)
        # masked_scatter fills positions in row-major order: sample by sample, left to right,
        # and ChatPrompt guarantees exactly tokens_per_image placeholders per image (image_counts
        # checked that the batch holds each sample's images), so the flat images (in sample
        # order, each sample's in marker order) land in their runs; a sample without images has no run.
        return embeds.masked_scatter(is_image, image_embeds.to(embeds.dtype))

    def _embedding_dtype(self) -> torch.dtype:
        return self.llm_model.get_input_embeddings().weight.dtype

    def _device(self) -> torch.device:
        return self.llm_model.get_input_embeddings().weight.device
