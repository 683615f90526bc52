"""The architecture-neutral half of a vision-LLM: the chat LLM, its prompt, LoRA, export, and (from its base,
``lavis_ds.models.vision_llm_forward``) the batch, the splice, loss and generate.

An architecture (``Blip2Qwen``, ...) subclasses ``VisionLLM`` and provides only its image path:

- ``encode_images(images, samples)``: ``[N, tokens_per_image, llm_hidden]`` for ``images [N, 3, H, W]``, or the
  flat ``[sum of counts, llm_hidden]`` (each image's rows a block, in image order) when the count depends on the
  image; ``samples`` is the prepared batch (InstructBLIP reads the instruction from it, a Qwen-VL tower its
  ``image_grid_thw``). Under packing the images arrive in packed order: ``samples["order"]`` lists the sample of each
  packed sample.
- ``tokens_per_image`` and ``image_size`` (instance attributes) and their config-side twins, its settings class's
  ``tokens_per_image()`` and ``image_size()`` (``SETTINGS``: ``lavis_ds.models.settings``); an image path whose
  count depends on the image's size overrides ``tokens_for_image(size)``, the one count the prompt's placeholders
  and the splice both follow (``lavis_ds.models.image_tokens``), and ``blank_images`` if its blank image needs a grid.
- ``vision_blocks()``: its transformer blocks, which a sharding engine gathers one at a time.
- optionally ``batch_fields(samples)``: more host-side tensors for ``prepare_batch`` (e.g. ``qformer_input_ids``).

Its constructor takes its own keyword-only arguments plus ``**llm_args`` (this class's arguments: the config
validator follows ``**kwargs`` up the MRO, so it sees every key with its type and default) and builds in this order,
the order its parameters (and the engines' flat optimizer states) take:

    super().__init__(**llm_args)      # the tokenizer and the LLM-side settings
    ... the parts that do not need the LLM (the tower) ...
    hidden = self.build_llm()         # self.llm_model, grad checkpointing; returns the LLM width
    ... the parts that do (the projection to ``hidden``), freezing its own parts ...
    self.finish_build()               # the prompt, the LLM's freezing, LoRA, trainable token rows
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Literal

from torch import nn
from transformers import PreTrainedModel

from lavis_ds.models.eva_vit import DTYPES
from lavis_ds.models.flops import FlopModel, Flops, compose
from lavis_ds.models.llm import (CHATML_TOKENS, add_lora, base_llm, build_llm, lora_target_names, merge_llm,
                                 num_token_ids, prepare_tokenizer, train_token_rows)
from lavis_ds.models.llm_families import decoder_layers, position_provider, transformers_config
from lavis_ds.models.prompt import ChatPrompt
from lavis_ds.models.settings.vision_llm import VisionLLMSettings
from lavis_ds.models.vision_llm_forward import VisionLLMForward

logger = logging.getLogger(__name__)


class VisionLLM(VisionLLMForward):
    """Image features spliced into a chat LLM at the image placeholder tokens; subclasses give the image path.

    This class builds the model (``SETTINGS`` answers the config's questions); what it computes on a batch (the
    splice, the loss, generation) is its base's (``lavis_ds.models.vision_llm_forward``)."""

    # What a `model:` section means without building (lavis_ds.models.settings), the prompt's layout included.
    SETTINGS = VisionLLMSettings
    # The state_dict prefix of the LLM: what merge_lora turns into a plain transformers model (export writes it as a
    # Hugging Face folder and the rest beside it).
    LLM_PREFIX = "llm_model."
    # Parameters built from the LLM's width (the connector): export writes them even when frozen, so that a model
    # rebuilt on the merged LLM never depends on how the LLM was built. Subclasses name theirs.
    CONNECTOR_PREFIXES: tuple[str, ...] = ()
    # The attributes the constructor sets are declared by the base (the model contract reads the declarations).

    # Over 50 lines: most of it is the keyword list, which is the model section's schema (the config check reads
    # the signature), so it stays in one place.
    def __init__(
        self,
        *,
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
            llm_model: Local Hugging Face folder of a causal LM (Qwen2.5, Qwen3, Llama 3.x, ...) to load
                with ``AutoModelForCausalLM.from_pretrained``. None builds a randomly initialised LLM
                from ``llm_config`` (tests, demos, meta-device checks).
            llm_config: Config arguments for the random-init LLM: ``model_type`` (default ``qwen2``) picks
                the transformers architecture, the rest are its config's keys; ignored when ``llm_model``
                is given. ``vocab_size`` defaults to the tokenizer's size.
            llm_precision: LLM parameter dtype; ``auto`` = the checkpoint's dtype (fp32 for random init).
            tokenizer: Local tokenizer folder; defaults to ``llm_model``. ChatML tokens and ``image_token``
                it lacks are added (see ``lavis_ds.models.llm``); the tokenizer as used is what
                ``save_run_files`` writes to the run's output_dir.
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
        self.llm_args = dict(llm_model=llm_model, llm_config=llm_config, llm_precision=llm_precision,
                             freeze_llm=freeze_llm, get_lora=get_lora, lora_r=lora_r, lora_alpha=lora_alpha,
                             lora_dropout=lora_dropout, lora_target_modules=lora_target_modules,
                             max_txt_len=max_txt_len, system_prompt=system_prompt, image_token=image_token,
                             chat_template_kwargs=chat_template_kwargs or {},
                             record_system_prompt=record_system_prompt)
        self.llm_grad_checkpoint = llm_grad_checkpoint
        self.loss_chunks = loss_chunks
        # Tokens the tokenizer lacked are added; rows only for ids past the embedding's spare rows.
        self.llm_tokenizer, self._added_tokens = prepare_tokenizer(tokenizer or llm_model, image_token,
                                                                   self.SETTINGS.PROMPT_TOKENS)

    # ----------------------------------------------------------------- building (the subclass calls these)
    def build_llm(self) -> int:
        """Build ``self.llm_model`` (placed as the runner building this model asks: whole, partitioned from the
        start, or empty until process 0 sends its shards; ``lavis_ds.models.llm_placement``); returns its width."""
        path, llm_config, precision = (self.llm_args[k] for k in ("llm_model", "llm_config", "llm_precision"))
        if path is not None and llm_config:
            logger.info("llm_model is set, so llm_config is ignored: the architecture comes from %s", path)
        architecture = None if path is not None else transformers_config(llm_config or {},
                                                                         vocab_size=num_token_ids(self.llm_tokenizer))
        self.llm_model = build_llm(path, architecture, None if precision == "auto" else DTYPES[precision],
                                   self.llm_tokenizer)
        if self.llm_grad_checkpoint:
            # Non-reentrant: gradients reach the image path through the LLM's inputs even when every
            # LLM weight is frozen, and dropout replays the same mask in the recomputation.
            kwargs = {"use_reentrant": False}
            if hasattr(self.llm_model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                self.llm_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.llm_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return self.llm_model.config.hidden_size

    def finish_build(self) -> None:
        """The prompt, then the LLM's freezing, LoRA and trainable token rows (after the image path: LoRA's
        initialisation draws random numbers, and the image path's must come first)."""
        args = self.llm_args
        self.prompt = ChatPrompt(self.llm_tokenizer, args["system_prompt"], args["image_token"],
                                 self.tokens_per_image, args["max_txt_len"], args["chat_template_kwargs"],
                                 record_system_prompt=args["record_system_prompt"], image_span=self.SETTINGS.IMAGE_SPAN,
                                 video_token=self.SETTINGS.VIDEO_TOKEN,
                                 video_frame_groups=self.SETTINGS.VIDEO_FRAME_GROUPS)
        self.end_of_turn_id = self.prompt.end_of_turn_id  # <|im_end|>, <|eot_id|>, <end_of_turn>, ...
        self.positions = position_provider(self.llm_transformers_config)  # 1-D, or M-RoPE for a Qwen-VL text model
        self.pad_id = self.llm_tokenizer.pad_token_id  # prepare_tokenizer guarantees one
        if args["get_lora"] and not args["freeze_llm"]:
            raise ValueError("get_lora=true trains only the LoRA adapters, so it needs freeze_llm=true")
        if args["freeze_llm"] and not args["get_lora"]:
            self.freeze_module("llm_model")
        # With LoRA, peft freezes the base weights itself, and the LLM keeps train mode for LoRA dropout.
        if args["get_lora"]:
            targets = args["lora_target_modules"]
            targets = lora_target_names(self.llm_model) if targets is None else targets
            self.llm_model = add_lora(self.llm_model, args["lora_r"], args["lora_alpha"], args["lora_dropout"],
                                      targets)
        new_chatml = [t for t in self._added_tokens if t in CHATML_TOKENS]
        if args["freeze_llm"] and new_chatml:
            # A frozen LLM never saw these tokens: without trained rows the chat format means nothing.
            logger.warning("the tokenizer lacked %s: their embedding and output rows train (only those rows)",
                           ", ".join(new_chatml))
            train_token_rows(base_llm(self.llm_model), self.llm_tokenizer.convert_tokens_to_ids(new_chatml))
        if self.llm_grad_checkpoint:
            self.train(self.training)  # freezing put the LLM's layers in eval: checkpointing follows the model

    # ----------------------------------------------------------------- the LLM as a whole
    @property
    def llm_transformers_config(self) -> Any:
        """The built LLM's transformers config (``hidden_size``, ``vocab_size``, ``max_position_embeddings``, ...);
        ``llm_config`` is the ``model:`` section's key it may have been built from."""
        return base_llm(self.llm_model).config

    def vision_blocks(self) -> list[nn.Module]:
        """The image path's transformer blocks (the tower's, a Q-Former's layers). Subclasses say."""
        return []

    def repeated_blocks(self) -> list[nn.Module]:
        """The image path's blocks, then the LLM's decoder layers: the units a sharding engine gathers one at a
        time. What is left (embeddings, norms, heads, queries, projection) belongs to the model as a whole."""
        return [*self.vision_blocks(), *decoder_layers(base_llm(self.llm_model))]

    def train(self, mode: bool = True) -> "VisionLLM":
        super().train(mode)
        if self.llm_grad_checkpoint and hasattr(self, "llm_model"):
            # Transformers checkpoints a decoder layer only while that layer is in training mode, and a
            # frozen LLM stays in eval. The layers' own flag follows the model; their submodules (the
            # attention's dropout) keep eval, so a frozen LLM still adds no noise.
            for layer in decoder_layers(base_llm(self.llm_model)):
                layer.training = mode
        return self

    def flop_model(self) -> FlopModel | None:
        """Training FLOPs per sample by part (tower, connector, LLM), for the parameters that train now
        (``lavis_ds.models.flops``); None if a part does not say (a user's part without ``flops``: no MFU logged).
        Reads only layer sizes and ``requires_grad``: works on partitioned weights (ZeRO-3, FSDP) and on the meta
        device."""
        image_path = self.image_path_flops()
        if image_path is None:
            return None
        tower, connector, image_grad = image_path
        return compose(tower, connector, image_grad, self.llm_model, not self._head_at_supervised_positions())

    def image_path_flops(self) -> tuple[Flops, Callable[[int], Flops], bool] | None:
        """The image path's FLOPs per image: the tower's, the connector's given its instruction tokens per image,
        and whether the connector's output needs a gradient; None if a part does not say. Default:
        ``self.vision_tower`` and ``self.connector`` report their own (``VisionTower.flops``, ``Connector.flops``)."""
        tower = self.vision_tower.flops()
        tokens = self.vision_tower.num_tokens
        connector = None if tower is None else self.connector.flops(tokens, tower[1])
        if connector is None:
            return None
        return tower[0], lambda text_tokens: self.connector.flops(tokens, tower[1], text_tokens)[0], connector[1]

    def merge_lora(self) -> PreTrainedModel:
        """Turn the LLM into a plain transformers model (``Qwen2ForCausalLM``, ...) with everything trained inside it
        folded in; for export.

        LoRA adapters are merged into the base weights (peft ``merge_and_unload``) and trained token rows (ChatML
        tokens the tokenizer lacked) are written into the embedding and output matrices. The plain model replaces
        ``self.llm_model`` (this model keeps working, with the same outputs) and is returned. Call it on a model
        outside the training engine whose trained weights are loaded (partitioned parameters are refused).
        """
        self.llm_model = merge_llm(self.llm_model)
        return self.llm_model

    def save_run_files(self, output_dir: str | Path) -> None:
        """Write ``output_dir/tokenizer``: the tokenizer as used, added tokens included, for export and inference."""
        self.llm_tokenizer.save_pretrained(Path(output_dir) / "tokenizer")
