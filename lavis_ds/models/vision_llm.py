"""A vision-LLM: a vision tower and a connector whose image tokens are spliced into a chat LLM at the image
placeholders, each a part the model holds, built from its config section::

    vision_tower: {name: clip, preset: vit_l_14_336, vision_feature_layer: -2}
    connector: {name: mlp2x_gelu}

(``lavis_ds.models.parts``), and the LLM's keys. The model holds:

- ``vision_tower``, ``llm_model`` and ``connector``, its registered modules (the state_dict's ``vision_tower.*``,
  ``llm_model.*`` and ``connector.*``);
- ``llm``, the LLM part (``lavis_ds.models.chat_llm.ChatLLM``): the causal LM as built (frozen, LoRA-wrapped) and
  its tokenizer, chat prompt, position numbering, pad and end-of-turn ids;
- ``image_path`` (``lavis_ds.models.image_path.ImagePath``, or the class the architecture names in
  ``IMAGE_PATH``): ``connector(vision_tower(images), inputs)``, a batch's features and their splice into the LLM's
  embeddings, the blocks a sharding engine gathers, the FLOPs;
- ``image_path.layout`` (``lavis_ds.models.image_layout``, the image path's ``LAYOUT``): each image's token count
  (the one count the prompt's placeholders and the splice both follow), the visuals M-RoPE numbers, the blank image;
- ``batch`` (``lavis_ds.models.vision_llm_batch.HostBatch``): what ``prepare_batch`` does on the host.

It computes the loss, the answers' log-probabilities and generation itself. A registered architecture (``llava``,
``instructblip``, ``blip2_qwen``, the Qwen-VL family) is a subclass naming its settings (``SETTINGS``: default
parts, presets, prompt tokens; ``lavis_ds.models.settings``), presets and image path; any tower with any connector
trains by YAML (``arch: llava`` with ``vision_tower: {name: siglip}`` and ``connector: {name: qformer}``).

Its constructor builds the parts in one step, in the order their random initialisations draw: the tower, the
connector (projecting to the LLM's width, read from its config), then the LLM part, its causal LM built with the
random number generator forked from where it stood after the tower, then frozen and LoRA-wrapped (LoRA's draws
after the connector's, as they always were: a seed gives the same weights). The modules register as tower, LLM,
connector: the order of the parameters that checkpoints and the engines' flat optimizer states hold.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import PreTrainedModel

from lavis_ds.common.registry import connectors, vision_towers
from lavis_ds.models.base import BaseModel
from lavis_ds.models.chat_llm import ChatLLM
from lavis_ds.models.flops import FlopModel
from lavis_ds.models.image_path import ImagePath
from lavis_ds.models.image_tokens import (batch_images, check_feature_rows, images_per_sample, per_sample,
                                         select_images)
from lavis_ds.models.linear_attention import boundary_kwargs
from lavis_ds.models.llm import base_llm
from lavis_ds.models.llm_families import llm_text_config
from lavis_ds.models.lm_loss import full_logits_loss, token_logps
from lavis_ds.models.parts import build_part
from lavis_ds.models.prompt import IGNORE_INDEX, image_counts, pad_batch, pad_positions
from lavis_ds.models.published import load_published
from lavis_ds.models.settings.base import model_settings
from lavis_ds.models.settings.composed import ComposedSettings, check_layouts, given_part_sections, tokens_per_image
from lavis_ds.models.vision_llm_batch import HostBatch, packed_image_order, sample_of_positions

logger = logging.getLogger(__name__)


class VisionLLM(BaseModel):
    """``vision_tower`` -> ``connector`` -> image tokens spliced into ``llm_model``; subclasses name their settings."""

    # What a `model:` section means without building (lavis_ds.models.settings), the prompt's layout included.
    SETTINGS = ComposedSettings
    # The state_dict prefix of the LLM: what merge_lora turns into a plain transformers model (export writes it as a
    # Hugging Face folder and the rest beside it).
    LLM_PREFIX = "llm_model."
    # Parameters built from the LLM's width (the connector): export writes them even when frozen, so that a model
    # rebuilt on the merged LLM never depends on how the LLM was built.
    CONNECTOR_PREFIXES = ("connector.",)
    # The architecture's image path (tower -> connector -> splice) and, by its LAYOUT, how its images become LLM
    # tokens on the host: both made from the tower and the connector.
    IMAGE_PATH: type[ImagePath] = ImagePath
    # Set by the constructor (the model contract's "chat" and "merge" needs read the declarations, models.base).
    llm: ChatLLM  # the LLM part: tokenizer, prompt, positions, pad and end-of-turn ids, the LLM's config
    image_path: ImagePath  # tower -> connector, the batch's features and their splice (image_path)
    batch: HostBatch  # the host side of prepare_batch (vision_llm_batch)

    # Over 50 lines: most of it is the keyword list, which is the model section's schema (the config check reads
    # the signature), so it stays in one place.
    def __init__(
        self,
        *,
        vision_tower: dict[str, Any] | None = None,
        connector: dict[str, Any] | None = None,
        llm_model: str | None = None,
        llm_config: dict[str, Any] | None = None,
        llm_precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto",
        tokenizer: str | None = None,
        freeze_llm: bool = True,
        llm_grad_checkpoint: bool = False,
        get_lora: bool = False,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.05,
        lora_target_modules: list[str] | None = None,
        max_txt_len: int = 512,
        system_prompt: str | None = "You are a helpful assistant.",
        record_system_prompt: Literal["use", "ignore", "fold"] = "use",
        image_token: str = "<|image_pad|>",
        chat_template_kwargs: dict[str, Any] | None = None,
        loss_chunks: int = 8,
    ):
        """
        Args:
            vision_tower: The tower's section: ``name`` (a registered tower: ``clip``, ``siglip``,
                ``eva_vit_g``, ...) plus its keys, ``pretrained`` (published weights) and ``freeze``
                (default true). Left out: the architecture's default tower.
            connector: The connector's section: ``name`` (``mlp2x_gelu``, ``linear``, ``qformer``,
                ``instruct_qformer``, ...) plus its keys, ``pretrained`` and ``freeze`` (default false). Its
                widths come from the tower and the LLM.
            llm_model: Local Hugging Face folder of a causal LM (Qwen2.5, Qwen3, Llama 3.x, ...) to load
                with ``AutoModelForCausalLM.from_pretrained``. None builds a randomly initialised LLM
                from ``llm_config`` (tests, demos, meta-device checks).
            llm_config: Config arguments for the random-init LLM: ``model_type`` (default ``qwen2``) picks
                the transformers architecture, the rest are its config's keys; ignored when ``llm_model``
                is given. ``vocab_size`` defaults to the tokenizer's size.
            llm_precision: LLM parameter dtype; ``auto`` = the checkpoint's dtype (fp32 for random init).
            tokenizer: Local tokenizer folder; defaults to ``llm_model``. ChatML tokens and ``image_token``
                it lacks are added (see ``lavis_ds.models.llm``); the tokenizer as used is what
                ``llm.save`` writes to the run's output_dir.
            freeze_llm: Freeze the LLM (required with ``get_lora``: only the adapters train).
            llm_grad_checkpoint: Recompute each LLM decoder layer in backward instead of keeping its
                activations (most of the memory of a frozen-LLM run, see docs/memory.md), frozen or not.
            get_lora: Add LoRA adapters (peft) to the LLM.
            lora_r: LoRA rank.
            lora_alpha: LoRA scaling numerator.
            lora_dropout: Dropout on the LoRA input.
            lora_target_modules: LLM module names to adapt (a name or dotted suffix of a linear layer in
                the decoder blocks; others raise, listing the valid ones); default every linear layer of the
                LLM's decoder blocks (the names its family gives them).
            max_txt_len: Longest training sequence in tokens, image placeholders included.
            system_prompt: Text of the system message; null sends none (for templates without a system role,
                such as Gemma's). A record's own system turn replaces it for that record (``record_system_prompt``).
            record_system_prompt: What a record's own system turn does: ``use`` (it is that sample's system message),
                ``ignore`` (``system_prompt`` for every sample), ``fold`` (its text goes in front of the first user
                turn: for templates without a system role).
            image_token: Placeholder token; added to the tokenizer if missing (the LLM embeddings grow
                only if its id has no row; its row never trains: image features replace it).
            chat_template_kwargs: Variables for the tokenizer's chat template, e.g. ``enable_thinking: false``
                (Qwen3) or ``date_string`` (Llama 3.x, which otherwise writes today's date into every prompt).
            loss_chunks: LM-head calls the supervised positions of a micro-batch are split into, each with its
                fp32 cross-entropy (``lavis_ds.models.lm_loss``: a number, the same on every rank, as ZeRO-3
                needs); 0 computes the LLM's full ``[B, T, vocab]`` logits instead (families the chunked path
                cannot reproduce always do).
        """
        super().__init__()
        if loss_chunks < 0:
            raise ValueError(f"loss_chunks must be >= 0 (0: full logits), got {loss_chunks}")
        tower_section, connector_section = given_part_sections(self.SETTINGS.DEFAULT_PARTS,
                                                               {"vision_tower": vision_tower, "connector": connector})
        check_layouts(self.SETTINGS.FLAT_FEATURES, tower_section, connector_section)
        tower = build_part(vision_towers, tower_section, "model.vision_tower")
        # A random-init LLM (tests, demos) is initialised from where it always was: right after the tower.
        llm_random_state = torch.random.get_rng_state()
        width = llm_text_config(llm_model, llm_config).hidden_size  # what the connector projects to
        part = build_part(connectors, connector_section, "model.connector", vision_width=tower.num_features,
                          llm_width=width)
        image_tokens = tokens_per_image(tower, part)  # None: each image's count follows its size
        self.llm = ChatLLM(  # the prompt's layout is the architecture's
            tokens_per_image=image_tokens, layout=self.SETTINGS.PROMPT_LAYOUT, random_state=llm_random_state,
            llm_model=llm_model, llm_config=llm_config,
            llm_precision=llm_precision, tokenizer=tokenizer, freeze_llm=freeze_llm,
            llm_grad_checkpoint=llm_grad_checkpoint, get_lora=get_lora, lora_r=lora_r, lora_alpha=lora_alpha,
            lora_dropout=lora_dropout, lora_target_modules=lora_target_modules, max_txt_len=max_txt_len,
            system_prompt=system_prompt, record_system_prompt=record_system_prompt, image_token=image_token,
            chat_template_kwargs=chat_template_kwargs, loss_chunks=loss_chunks)
        if self.llm.config.hidden_size != width:
            raise RuntimeError(f"lavis_ds: the LLM built from {llm_model or 'model.llm_config'} is "
                               f"{self.llm.config.hidden_size} wide, its config read {width}: the connector would "
                               "project to the wrong width")
        # Registered in this order (tower, LLM, connector): the order of the parameters that checkpoints and the
        # engines' flat optimizer states hold.
        self.vision_tower = tower
        self.llm_model = self.llm.model
        self.connector = part
        self.image_path = self.IMAGE_PATH(tower, part, image_tokens, self.llm, type(self).__name__)
        self.batch = HostBatch(self.llm, self.image_path.layout, self.image_path.host_inputs)
        if self.llm.eval_only:  # frozen by the LLM part already (its trainable token rows keep their gradient)
            self._eval_only = self._eval_only | {"llm_model"}
        if llm_grad_checkpoint:
            self.train(self.training)  # freezing put the LLM's layers in eval: checkpointing follows the model

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | DictConfig) -> "VisionLLM":
        """Build from a ``model:`` section; a published folder in ``pretrained`` (with ``load_pretrained``) first
        gives the settings that come with its weights (``models.published.settings_from_published``)."""
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        return super().from_config(model_settings(cls, cfg).with_published())

    def load_from_pretrained(self, path: str) -> None:
        """A ``LlavaForConditionalGeneration`` or ``InstructBlipForConditionalGeneration`` folder (every part),
        LAVIS's InstructBLIP ``.pth`` or LLaVA's stage-1 ``mm_projector.bin`` (the parts it holds); each part
        checked against the configured one (``lavis_ds.models.published``)."""
        load_published(self, path)

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
            counts = samples.get("image_tokens") or self.image_path.layout.counts(samples)
            check_feature_rows(features.shape[0], counts, images_per_sample(samples, counts),
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
        if self.llm.head_at_supervised_positions():
            token_losses = -token_logps(self.llm_model, inputs_embeds, layout, labels, self.llm.loss_chunks,
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
        logps, positions = token_logps(self.llm_model, inputs_embeds, layout, labels, self.llm.loss_chunks,
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
        counts = per_sample(self.image_path.layout.counts(samples), num_images)
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

    # ----------------------------------------------------------------- the LLM as a whole
    def repeated_blocks(self) -> list[nn.Module]:
        """The image path's blocks, then the LLM's decoder layers: the units a sharding engine gathers one at a
        time. What is left (embeddings, norms, heads, queries, projection) belongs to the model as a whole."""
        return [*self.image_path.blocks(), *self.llm.blocks()]

    def train(self, mode: bool = True) -> "VisionLLM":
        super().train(mode)
        llm = self.__dict__.get("llm")  # None while the constructor runs
        if llm is not None:
            llm.set_training(mode)
        return self

    def flop_model(self) -> FlopModel | None:
        """Training FLOPs per sample by part (tower, connector, LLM), for the parameters that train now
        (``ImagePath.flop_model``); None if a part does not say. Reads only layer sizes and ``requires_grad``: works
        on partitioned weights (ZeRO-3, FSDP) and on the meta device."""
        return self.image_path.flop_model()

    def merge_lora(self) -> PreTrainedModel:
        """Turn the LLM into a plain transformers model (``Qwen2ForCausalLM``, ...) with everything trained inside it
        folded in; for export.

        LoRA adapters are merged into the base weights (peft ``merge_and_unload``) and trained token rows (ChatML
        tokens the tokenizer lacked) are written into the embedding and output matrices. The plain model replaces
        ``self.llm_model`` (this model keeps working, with the same outputs) and is returned. Call it on a model
        outside the training engine whose trained weights are loaded (partitioned parameters are refused).
        """
        self.llm_model = self.llm.merge_lora()
        return self.llm_model

    def save_run_files(self, output_dir: str | Path) -> None:
        """Write ``output_dir/tokenizer``: the tokenizer as used, added tokens included (``llm.save``)."""
        self.llm.save(output_dir)
