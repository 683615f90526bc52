"""What a vision-LLM computes on a batch: the prompts tokenized, the image features spliced into the LLM's input
embeddings at the placeholder tokens, the loss, the answers' log-probabilities and generation.

:class:`VisionLLMForward` is the base of ``lavis_ds.models.vision_llm.VisionLLM``, which builds the parts these
methods run (``llm_model``, ``prompt``, ...) and which architectures subclass; they give the image path
(``encode_images``) and may add host-side batch fields (``batch_fields``).
"""
from __future__ import annotations

from typing import Any, Literal

import torch

from lavis_ds.models.base import BaseModel
from lavis_ds.models.chat_llm import ChatLLM
from lavis_ds.models.image_tokens import (Size, batch_images, check_feature_rows, flat_features, image_sizes,
                                           per_sample, select_images)
from lavis_ds.models.linear_attention import boundary_kwargs
from lavis_ds.models.llm import base_llm
from lavis_ds.models.lm_loss import full_logits_loss, head_loss_supported, token_logps
from lavis_ds.models.positions import Visual
from lavis_ds.models.prompt import IGNORE_INDEX, ImageSpanCut, image_counts, pad_batch, pad_positions
from lavis_ds.models.vision_llm_batch import (blank_sample, keep_samples, lay_out, log_drop, packed_image_order,
                                              sample_of_positions, training_examples)


class VisionLLMForward(BaseModel):
    """The batch, the splice, the loss and generation of a ``VisionLLM``, whose constructor sets the attributes
    below."""

    PACKS = True  # prepare_batch(samples, pack_to=N) packs samples into rows (lavis_ds.models.packing)
    # prepare_batch(samples, on_image_cut="drop") leaves out the samples truncation would cut into an image
    # (the SFT objective's run.sft.on_image_cut)
    CUTS_IMAGE_SAMPLES = True
    # Keys ``batch_fields`` adds that hold one row per image, in image order (e.g. an instruction connector's BERT
    # tokens): a batch whose samples share images (a preference pair's two sides) keeps one row per distinct image.
    PER_IMAGE_FIELDS: tuple[str, ...] = ()
    # Set by VisionLLM's constructor (and the model contract's "chat" and "merge" needs, models.base.CONTRACT).
    tokens_per_image: int | None
    image_size: int
    llm: ChatLLM  # the LLM part: tokenizer, prompt, positions, pad and end-of-turn ids, the LLM's config
    llm_model: Any  # the transformers causal LM (peft-wrapped with LoRA): llm.model, registered here
    loss_chunks: int
    image_cut_drops: int = 0  # samples prepare_batch dropped in this process (on_image_cut: drop), for the log

    def _head_at_supervised_positions(self) -> bool:
        """Whether the loss applies the LM head at the supervised positions only (``lavis_ds.models.lm_loss``)."""
        return bool(self.loss_chunks) and head_loss_supported(base_llm(self.llm_model))

    # ----------------------------------------------------------------- the batch
    def batch_fields(self, samples: dict[str, Any]) -> dict[str, Any]:
        """More host-side fields the image path needs (e.g. InstructBLIP's ``qformer_input_ids``), one entry per
        sample in sample order, computed by ``prepare_batch`` on the host. Default: none."""
        return {}

    def tokens_for_image(self, size: Size) -> int:
        """LLM tokens an image of ``size`` takes (``lavis_ds.models.image_tokens``: its grid row, or its pixels'
        (height, width)): the one count the prompt's placeholders and the spliced features both follow. Default: the
        architecture's fixed ``tokens_per_image``; an image path whose count depends on the size says."""
        return self.tokens_per_image

    def image_token_counts(self, samples: dict[str, Any]) -> list[int]:
        """Each image's token count (``tokens_for_image``), in the batch's flat image order."""
        return [self.tokens_for_image(size) for size in image_sizes(samples)]

    def prepare_batch(self, samples: dict[str, Any], pack_to: int | None = None,
                      on_image_cut: Literal["drop", "refuse"] = "refuse") -> dict[str, Any]:
        """The prompts rendered and tokenized on the host: ``input_ids``, ``attention_mask``, ``labels``, each image's
        placeholder count ``image_tokens`` added (and ``batch_fields``). A batch that has ``labels`` is already
        prepared and returned as given.

        ``pack_to``: lay the samples end to end in rows of at most that many tokens instead of padding each
        (``position_ids``, per-sample lengths and the packed ``order`` added; see ``models.packing``).
        ``on_image_cut``: a sample that ``max_txt_len`` would cut inside (or before) an image's placeholders is
        refused (``ImageSpanCut`` naming it) or dropped from the batch with its images, and counted in the log."""
        if "labels" in samples:
            return samples
        examples, samples = self._examples(samples, on_image_cut)
        extra = {**self.batch_fields(samples), "image_tokens": self.image_token_counts(samples)}
        rope = self._rope_positions([ids for ids, _ in examples], samples)
        return {**samples, **extra, **lay_out(examples, self.llm.pad_id, pack_to, rope)}

    def image_visuals(self, samples: dict[str, Any]) -> list[Visual]:
        """Each image as the LLM's position provider sees it (flat image order): its token count and, for an image
        path that lays its tokens out on a grid, that grid of LLM tokens. Default: no grid (a Q-Former's queries, a
        pooled tower's tokens are numbered as text is); an image path with a grid (Qwen-VL's) says."""
        return [Visual(n) for n in self.image_token_counts(samples)]

    def positioned_visuals(self, samples: dict[str, Any]) -> list[list[Visual]]:
        """Each sample's placeholder runs as the position provider numbers them, in order: its ``image_visuals``
        (a family that writes a video as several runs gives each run)."""
        return per_sample(self.image_visuals(samples), image_counts(samples))

    def _rope_positions(self, sequences: list[list[int]], samples: dict[str, Any]) -> list[torch.Tensor] | None:
        """Each sample's ``[rows, L]`` position ids from the LLM family's provider, when it takes more than one row
        (M-RoPE); None for 1-D families, whose positions are ``0..L-1`` (packing's ``position_ids``)."""
        if self.llm.positions.rows == 1:
            return None
        visuals = self.positioned_visuals(samples)
        placeholders, provider = self.llm.prompt.placeholder_ids, self.llm.positions
        return [provider.positions(ids, placeholders, mine) for ids, mine in zip(sequences, visuals, strict=True)]

    def _examples(self, samples: dict[str, Any], on_image_cut: str
                  ) -> tuple[list[tuple[list[int], list[int]]], dict[str, Any]]:
        """Each sample's ``(input_ids, labels)`` and the batch they belong to: ``samples``, or without the samples
        truncation would cut into an image (``on_image_cut: drop``; a batch left empty keeps one blank sample)."""
        counts = per_sample(self.image_token_counts(samples), image_counts(samples))
        examples = training_examples(self.llm.prompt, samples, counts)
        kept = [i for i, example in enumerate(examples) if not isinstance(example, ImageSpanCut)]
        if len(kept) == len(examples):
            return examples, samples
        for cut in (example for example in examples if isinstance(example, ImageSpanCut)):
            if on_image_cut != "drop":
                raise cut
            self.image_cut_drops += 1
            log_drop(cut.where, cut, self.image_cut_drops)
        if not kept:  # every rank runs a forward (ZeRO-3 / FSDP collectives): one token, nothing supervised
            return [([self.llm.pad_id], [IGNORE_INDEX])], blank_sample(samples)
        return [examples[i] for i in kept], keep_samples(samples, kept)

    def supervised_tokens(self, samples: dict[str, Any]) -> int:
        """The answer tokens (and end-of-turn tokens) the loss of ``forward`` sums over: labels[:, 1:] supervised."""
        return int((samples["labels"][:, 1:] != IGNORE_INDEX).sum())

    # ----------------------------------------------------------------- forward
    def image_embeds(self, image: torch.Tensor | None, dummy: bool, samples: dict[str, Any] | None = None
                     ) -> torch.Tensor:
        """Features of every image of a batch, flat: ``[sum of image_token_counts, llm_hidden]`` in the LLM
        embedding dtype, each image's rows a block in image order (``image`` holds all samples' images in order, with
        the batch's grid in ``samples`` where it has one; the tower runs once on it).

        A batch with no image (text-only samples only) gives ``[0, hidden]``, or with ``dummy`` the features of
        one blank image (``blank_images``), which the caller adds to its embeddings times zero (``forward``). Why run
        the towers for nothing: ZeRO-3 and FSDP gather a module's parameters when it runs, as a collective, so every
        rank must run the same modules in each forward or the ranks wait for each other forever; and the trainable
        parts (projection, queries) then get a gradient - zero - on every rank, as the engines' gradient
        reduction expects. Skipping the towers only where no rank has an image would need a collective per
        micro-batch; the blank image costs one image's tower pass, only in image-free micro-batches.
        """
        view = {**(samples or {}), "image": image}
        dtype = self._embedding_dtype()
        if image is not None and batch_images(view):
            counts = self.image_token_counts(view)
            nums = [int(n) for n in view.get("num_images") or ()]
            images_per_sample = nums if sum(nums) == len(counts) else [len(counts)]
            return flat_features(self.encode_images(image, view), counts, images_per_sample,
                                 f"{type(self).__name__}.encode_images").to(dtype)
        device = self._device() if image is None else image.device
        if not dummy:
            return torch.zeros((0, self.llm.config.hidden_size), device=device, dtype=dtype)
        blank = {**view, **self.blank_images(device)}
        features = self.encode_images(blank["image"], blank)
        return (features.flatten(0, 1) if features.dim() == 3 else features).to(dtype)

    def blank_images(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The image fields of one blank image, which a batch without images runs the image path on (``image_embeds``):
        ``image [1, 3, image_size, image_size]``; an image path that takes a grid adds its ``image_grid_thw``."""
        return {"image": torch.zeros((1, 3, self.image_size, self.image_size), device=device)}

    def encode_images(self, images: torch.Tensor, samples: dict[str, Any]) -> torch.Tensor:
        """``images`` (the batch's ``image``; ``samples`` holds its grid, if any) -> the features of every image:
        ``[N, tokens_per_image, llm_hidden]`` when every image takes the same count, else flat ``[sum of counts,
        llm_hidden]``, each image's ``tokens_for_image(size)`` rows in image order. The architecture's image path."""
        raise NotImplementedError(f"{type(self).__name__} must define encode_images")

    def image_features(self, samples: dict[str, Any]) -> torch.Tensor:
        """The flat image features of a prepared batch (packed order under packing; a blank image's when it has
        none), to pass to ``answer_logps`` for several batches that share the images (a preference pair)."""
        image = samples.get("image")
        if image is not None and "position_ids" in samples and batch_images(samples):
            # The image fields in packed order; the per-sample fields stay in sample order (an instruction
            # connector reorders its own rows, ComposedVisionLLM.encode_images).
            samples = {**samples, **select_images(samples, packed_image_order(samples).tolist())}
            image = samples["image"]
        return self.image_embeds(image, dummy=True, samples=samples)

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
            counts = samples.get("image_tokens") or self.image_token_counts(samples)
            # Named per sample where the counts are the samples' (a preference pair's sides share the pair's images).
            nums = [int(n) for n in samples.get("num_images") or ()]
            check_feature_rows(features.shape[0], counts, nums if sum(nums) == len(counts) else [len(counts)],
                               "the image features given")
        inputs_embeds, more = self.llm_inputs(input_ids, features if has_images else features[:0])
        layout.update(more)
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
        counts = per_sample(self.image_token_counts(samples), num_images)
        videos = per_sample(self.llm.prompt.video_marks(samples), num_images)
        prompt = self.llm.prompt
        prompts = [prompt.generation_prompt(ins, out, len(mine), image_tokens=mine, system=system, videos=video)
                   for ins, out, mine, system, video in zip(samples["instruction"], answers, counts, systems, videos,
                                                            strict=True)]
        input_ids, attention_mask = pad_batch(prompts, self.llm.pad_id, side="left")
        device = self._device() if image is None else image.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

        # Parameters of this root module (query tokens, ...): an engine that shards them gathers them for generate
        # (which is not forward) itself. Sharded ranks run the towers even without an image (image_embeds).
        image_embeds = self.image_embeds(image, dummy=synced_gpus, samples=samples)
        inputs_embeds, more = self.llm_inputs(input_ids, image_embeds if sum(num_images) else image_embeds[:0])
        # The placeholders are never words: generating one would feed its meaningless row back in.
        options = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=self.llm.stop_token_ids(), pad_token_id=self.llm.pad_id, synced_gpus=synced_gpus,
                       suppress_tokens=self.llm.prompt.placeholder_ids)
        options.update(more)
        options.update(generate_kwargs)
        rope = self._rope_positions(prompts, samples)
        if rope is not None:
            # The prompt's M-RoPE ids; generate continues each row at its last id + 1, which is a new token's plain
            # position plus its sample's rope delta (what transformers' Qwen2-VL keeps as rope_deltas).
            options["position_ids"] = pad_positions(rope, input_ids.shape[1], side="left").to(device)
        # With only inputs_embeds, generate returns just the new tokens.
        new_tokens = self.llm_model.generate(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **options)
        return [text.strip() for text in self.llm.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def llm_inputs(self, input_ids: torch.Tensor, image_embeds: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The LLM's input embeddings (``_embed``) and what more of the image features its forward takes as
        arguments (Qwen3-VL's DeepStack features, ``models.qwen3_vl``). Default: the embeddings alone."""
        return self._embed(input_ids, image_embeds), {}

    def _embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings with each placeholder run replaced by its image's features."""
        embeds = self.llm_model.get_input_embeddings()(input_ids)
        image_id, *video_id = self.llm.prompt.placeholder_ids  # an image's run, or a video's (its own token)
        is_image = input_ids == image_id
        for token in video_id:
            is_image = is_image | (input_ids == token)
        is_image = is_image.unsqueeze(-1)
        # masked_scatter fills positions in row-major order: sample by sample, left to right,
        # and ChatPrompt reserved exactly tokens_for_image(size) placeholders per image, the rows image_embeds
        # checked the features have, so the flat features (in sample order, each sample's images in marker
        # order) land in their runs; a sample without images has no run.
        return embeds.masked_scatter(is_image, image_embeds.to(embeds.dtype))

    def _embedding_dtype(self) -> torch.dtype:
        return self.llm_model.get_input_embeddings().weight.dtype

    def _device(self) -> torch.device:
        return self.llm_model.get_input_embeddings().weight.device
