"""The LLM part of a vision-LLM: the transformers causal LM as it trains (frozen, LoRA-wrapped, grad-checkpointed)
and its text side (tokenizer, chat prompt, position numbering, pad and end-of-turn ids).

An architecture holds one as ``model.llm`` and registers its causal LM as ``model.llm_model`` (the state_dict
prefix of checkpoints and exports). Runners, apps and objectives read the text side from it: ``model.llm.tokenizer``,
``model.llm.prompt``, ``model.llm.pad_id``, ``model.llm.stop_token_ids()``, ``model.llm.config``.

It is built in one step, after the image path: LoRA's initialisation draws random numbers, and the image path's
come first. The causal LM is built with the random number generator forked (``models.llm.build_llm``), from the
state the architecture hands it (``random_state``: where the LLM's initialisation always started, after the
tower's), so a seed gives the weights it always gave.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import PreTrainedModel

from lavis_ds.models.eva_vit import DTYPES
from lavis_ds.models.llm import (CHATML_TOKENS, add_lora, base_llm, build_llm, lora_problem, lora_target_names,
                                 merge_llm, num_token_ids, prepare_tokenizer, train_token_rows)
from lavis_ds.models.llm_families import decoder_layers, position_provider, transformers_config
from lavis_ds.models.lm_loss import head_loss_supported
from lavis_ds.models.prompt import PromptLayout

logger = logging.getLogger(__name__)


class ChatLLM:
    """The causal LM (``model``, registered by the architecture as ``llm_model``) and its text side."""

    # Over 50 lines: the keyword list is the LLM side of the model section (VisionLLM documents each key).
    def __init__(self, *, tokens_per_image: int | None, layout: PromptLayout = PromptLayout(),
                 random_state: torch.Tensor | None = None,
                 llm_model: str | None = None, llm_config: dict[str, Any] | None = None,
                 llm_precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto", tokenizer: str | None = None,
                 freeze_llm: bool = True, llm_grad_checkpoint: bool = False, get_lora: bool = False, lora_r: int = 8,
                 lora_alpha: int = 16, lora_dropout: float = 0.05, lora_target_modules: list[str] | None = None,
                 max_txt_len: int = 512, system_prompt: str | None = "You are a helpful assistant.",
                 record_system_prompt: Literal["use", "ignore", "fold"] = "use", image_token: str = "<|image_pad|>",
                 chat_template_kwargs: dict[str, Any] | None = None, loss_chunks: int = 8):
        """
        Args:
            tokens_per_image: Image placeholders per image (None: each image's count follows its size).
            layout: The architecture's prompt tokens besides the image token.
            random_state: The random number generator's state a random-init LLM is initialised from
                (``torch.random.get_rng_state()``); None: the current one. The generator itself is left as it is.
            The rest: the ``model:`` section's LLM keys (``lavis_ds.models.vision_llm.VisionLLM``); ``loss_chunks``
                (>= 0, checked there) the LM-head calls a micro-batch's supervised positions are split into.
        """
        if problem := lora_problem(get_lora, freeze_llm):
            raise ValueError(problem)
        # Tokens the tokenizer lacked are added; rows only for ids past the embedding's spare rows.
        self.tokenizer, added = prepare_tokenizer(tokenizer or llm_model, image_token, layout.prompt_tokens)
        model = _causal_lm(llm_model, llm_config, llm_precision, self.tokenizer, random_state)
        self.grad_checkpoint = llm_grad_checkpoint
        self.loss_chunks = loss_chunks
        if llm_grad_checkpoint:
            _checkpoint_layers(model)
        self.config = model.config  # the LLM's transformers config (hidden_size, vocab_size, max_position_embeddings)
        self.prompt = layout.chat_prompt(self.tokenizer, system_prompt, image_token, tokens_per_image, max_txt_len,
                                         chat_template_kwargs, record_system_prompt)
        self.end_of_turn_id = self.prompt.end_of_turn_id  # <|im_end|>, <|eot_id|>, <end_of_turn>, ...
        self.positions = position_provider(self.config)  # 1-D, or M-RoPE for a Qwen-VL text model
        self.pad_id = self.tokenizer.pad_token_id  # prepare_tokenizer guarantees one
        # Frozen whole (no adapters): the architecture keeps it in eval. With LoRA, peft freezes the base weights
        # itself, and the LLM keeps train mode for LoRA dropout.
        self.eval_only = freeze_llm and not get_lora
        if self.eval_only:
            model.requires_grad_(False)
            model.eval()
        if get_lora:
            targets = lora_target_names(model) if lora_target_modules is None else lora_target_modules
            model = add_lora(model, lora_r, lora_alpha, lora_dropout, targets)
        new_chatml = [t for t in added if t in CHATML_TOKENS]
        if freeze_llm and new_chatml:
            # A frozen LLM never saw these tokens: without trained rows the chat format means nothing.
            logger.warning("the tokenizer lacked %s: their embedding and output rows train (only those rows)",
                           ", ".join(new_chatml))
            train_token_rows(base_llm(model), self.tokenizer.convert_tokens_to_ids(new_chatml))
        self.model = model  # the transformers causal LM (peft-wrapped with LoRA)

    def stop_token_ids(self) -> list[int]:
        """Where generation stops: a turn ends with the template's end-of-turn token (<|im_end|>, <|eot_id|>, ...);
        a base model's tokenizer may name another eos (<|endoftext|>): stop at either."""
        eos = self.tokenizer.eos_token_id
        return list(dict.fromkeys(t for t in (self.end_of_turn_id, eos) if t is not None))

    def head_at_supervised_positions(self) -> bool:
        """Whether the loss applies the LM head at the supervised positions only, in ``loss_chunks`` calls
        (``lavis_ds.models.lm_loss``); else the LLM's own full ``[B, T, vocab]`` logits (``loss_chunks: 0``, or a
        family the chunked path cannot reproduce)."""
        return bool(self.loss_chunks) and head_loss_supported(base_llm(self.model))

    def blocks(self) -> list[nn.Module]:
        """The decoder layers: the units a sharding engine gathers one at a time."""
        return decoder_layers(base_llm(self.model))

    def set_training(self, mode: bool) -> None:
        """After the model's ``train(mode)``: transformers checkpoints a decoder layer only while that layer is in
        training mode, and a frozen LLM stays in eval. The layers' own flag follows the model; their submodules (the
        attention's dropout) keep eval, so a frozen LLM still adds no noise."""
        if self.grad_checkpoint:
            for layer in self.blocks():
                layer.training = mode

    def merge_lora(self) -> PreTrainedModel:
        """The causal LM as a plain transformers model, LoRA merged and trained token rows folded in
        (``models.llm.merge_llm``); it replaces ``model`` and is returned."""
        self.model = merge_llm(self.model)
        return self.model

    def save(self, output_dir: str | Path) -> None:
        """Write ``output_dir/tokenizer``: the tokenizer as used, added tokens included, for export and inference."""
        self.tokenizer.save_pretrained(Path(output_dir) / "tokenizer")


def _causal_lm(path: str | None, llm_config: dict[str, Any] | None, precision: str, tokenizer: Any,
               random_state: torch.Tensor | None) -> PreTrainedModel:
    """The causal LM of ``path`` or, without one, a random initialisation of ``llm_config``; placed as the runner
    building the model asks (``lavis_ds.models.llm_placement``)."""
    if path is not None and llm_config:
        logger.info("llm_model is set, so llm_config is ignored: the architecture comes from %s", path)
    architecture = None if path is not None else transformers_config(llm_config or {},
                                                                     vocab_size=num_token_ids(tokenizer))
    return build_llm(path, architecture, None if precision == "auto" else DTYPES[precision], tokenizer, random_state)


def _checkpoint_layers(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in backward. Non-reentrant: gradients reach the image path through the LLM's
    inputs even when every LLM weight is frozen, and dropout replays the same mask in the recomputation."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
