"""BLIP2-Qwen (the MiniGPT4Qwen recipe): EVA-ViT -> ln_vision -> Q-Former -> Linear -> chat LLM.

The LLM is Qwen2.5 by default and any transformers causal LM on request
(``lavis_ds.models.llm_families``). The projected query outputs replace the embeddings
of the image placeholder tokens in a prompt rendered by the tokenizer's chat template
(see ``lavis_ds.models.prompt``); the loss covers the assistant's answers only.
Attribute names follow MiniGPT4Qwen (``visual_encoder``,
``ln_vision``, ``query_tokens``, ``llm_proj``, ``llm_model``) so its trainable-part
checkpoints keep their keys; the Q-Former is Hugging Face's (``qformer``).

One class holds the model and everything the model contract asks of it (building and freezing,
the host-side batch preparation, forward, generate), about 500 lines with its argument docs; the
pieces that stand alone live beside it (``eva_vit``, ``llm``, ``prompt``, ``packing``, ``flops``).
"""
from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Blip2QFormerConfig, Blip2QFormerModel, PreTrainedModel

from lavis_ds.common.registry import registry
from lavis_ds.models.base import BaseModel
from lavis_ds.models.eva_vit import DTYPES, EvaViT, Precision
from lavis_ds.models.flops import FlopModel, flop_model
from lavis_ds.models.llm import (CHATML_TOKENS, add_lora, base_llm, build_llm, lora_target_names, merge_llm,
                                 num_token_ids, prepare_tokenizer, train_token_rows)
from lavis_ds.models.llm_families import decoder_layers, llm_config, llm_config_problems
from lavis_ds.models.pretrained import load_blip2
from lavis_ds.models.packing import pack
from lavis_ds.models.prompt import IGNORE_INDEX, ChatPrompt, image_counts, pad_batch

logger = logging.getLogger(__name__)

# The ViT presets by name; a Literal so that the config validator catches a misspelt `vit_model`.
VitPreset = Literal[tuple(EvaViT.PRETRAINED_MODEL_CONFIG_DICT)]  # type: ignore[valid-type]
# ViT settings that have their own top-level key (MiniGPT4Qwen's names); `vit:` must not repeat them.
VIT_KEYS_SET_AT_TOP_LEVEL = {"img_size": "image_size", "drop_path_rate": "drop_path_rate",
                             "use_grad_checkpoint": "use_grad_checkpoint", "precision": "vit_precision",
                             "pretrained": "vit_pretrained", "load_pretrained": "vit_pretrained"}


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the input and parameter dtypes, returned in the input dtype.

    LAVIS's ``ln_vision`` does the same for fp16; here the parameters may be bf16 too
    (DeepSpeed casts the whole module), and statistics over 1408 channels in half
    precision lose too much. Being a module (not a functional call) lets ZeRO-3 gather it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


@registry.register_model("blip2_qwen")
class Blip2Qwen(BaseModel):
    """BLIP-2 vision tower and Q-Former bridged into a chat LLM (Qwen2.5 by default) by one linear projection."""

    PRETRAINED_MODEL_CONFIG_DICT = {
        "qwen2.5_7b_instruct": "models/blip2_qwen/qwen2.5_7b_instruct.yaml",
        "qwen2.5_1.5b_instruct": "models/blip2_qwen/qwen2.5_1.5b_instruct.yaml",
        "qwen3_8b": "models/blip2_qwen/qwen3_8b.yaml",
        "qwen3_1.7b": "models/blip2_qwen/qwen3_1.7b.yaml",
        "llama3.1_8b_instruct": "models/blip2_qwen/llama3.1_8b_instruct.yaml",
        "llama3.2_3b_instruct": "models/blip2_qwen/llama3.2_3b_instruct.yaml",
        "llama3.2_1b_instruct": "models/blip2_qwen/llama3.2_1b_instruct.yaml",
        "tiny": "models/blip2_qwen/tiny.yaml",
    }
    # Nested dict keys and the class whose arguments they are: the config validator checks them too
    # (`llm_config` is not listed: transformers configs take extra keys on purpose).
    NESTED_SCHEMAS = {"qformer": Blip2QFormerConfig, "vit": EvaViT}
    # MiniGPT4Qwen's (Coobiw/MPP-LLaVA) model_types: Qwen-1 chat models, tiktoken tokenizer and remote code.
    _QWEN1 = "it is MiniGPT4Qwen's Qwen-1 chat model (tiktoken tokenizer, remote code), which lavis_ds does not load"
    REPLACED_MODEL_TYPES = {
        "qwen7b_chat": ("qwen2.5_7b_instruct", _QWEN1),
        "qwen14b_chat": ("qwen2.5_7b_instruct", _QWEN1),
        "qwen1.8b_chat": ("qwen2.5_1.5b_instruct", _QWEN1),
    }

    def __init__(
        self,
        *,
        vit_model: VitPreset = "eva_vit_g",
        vit: dict[str, Any] | None = None,
        image_size: int = 224,
        drop_path_rate: float = 0.0,
        use_grad_checkpoint: bool = False,
        vit_precision: Precision = "fp16",
        vit_pretrained: str | None = None,
        freeze_vit: bool = True,
        unfreeze_pos_embed: bool = False,
        num_query_token: int = 32,
        qformer: dict[str, Any] | None = None,
        freeze_qformer: bool = True,
        freeze_queries: bool = True,
        freeze_proj: bool = False,
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
        image_token: str = "<|image_pad|>",
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        """
        Args:
            vit_model: Preset (model_type of ``eva_vit_g``) giving the ViT sizes: ``eva_vit_g``
                (alias ``eva_clip_g``) or ``tiny``.
            vit: Overrides of that preset's ``EvaViT`` arguments (not the four set below).
            image_size: Input image side; sets the ViT's ``img_size``.
            drop_path_rate: ViT stochastic depth.
            use_grad_checkpoint: Gradient checkpointing in the ViT blocks.
            vit_precision: ViT parameter dtype (LAVIS keeps the frozen tower in fp16).
            vit_pretrained: LAVIS ``eva_vit_g.pth`` to load into the ViT, whatever ``load_pretrained``
                says (LAVIS always loads it). ``pretrained`` (a BLIP-2 checkpoint) is loaded after it
                and wins for the ViT if it holds ViT weights too.
            freeze_vit: Freeze the ViT (kept in eval mode).
            unfreeze_pos_embed: With ``freeze_vit``, still train the ViT position embedding.
            num_query_token: Q-Former queries = image placeholder tokens in the prompt.
            qformer: ``Blip2QFormerConfig`` arguments; defaults are BLIP-2's (768 wide, 12 layers).
                ``encoder_hidden_size`` is the ViT width.
            freeze_qformer: Freeze the Q-Former and ``ln_vision``.
            freeze_queries: Freeze the query tokens.
            freeze_proj: Freeze the Q-Former -> LLM projection.
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
                such as Gemma's).
            image_token: Placeholder token; added to the tokenizer if missing (the LLM embeddings grow
                only if its id has no row; its row never trains: image features replace it).
            chat_template_kwargs: Variables for the tokenizer's chat template, e.g. ``enable_thinking: false``
                (Qwen3) or ``date_string`` (Llama 3.x, which otherwise writes today's date into every prompt).
        """
        super().__init__()
        self.llm_grad_checkpoint = llm_grad_checkpoint
        self.image_size = image_size
        self.visual_encoder = self._build_vit(vit_model, vit, image_size, drop_path_rate,
                                              use_grad_checkpoint, vit_precision, vit_pretrained)
        self.vit_pretrained = vit_pretrained
        vit_width = self.visual_encoder.num_features
        self.ln_vision = FP32LayerNorm(vit_width)

        qformer_kwargs = dict(qformer or {})
        if qformer_kwargs.setdefault("encoder_hidden_size", vit_width) != vit_width:
            raise ValueError(f"qformer.encoder_hidden_size={qformer_kwargs['encoder_hidden_size']} "
                             f"must equal the ViT width {vit_width} (or be left out)")
        self.qformer = Blip2QFormerModel(Blip2QFormerConfig(**qformer_kwargs))
        qformer_width = self.qformer.config.hidden_size
        self.query_tokens = nn.Parameter(torch.zeros(1, num_query_token, qformer_width))
        # BLIP-2 initialises the queries like BERT weights.
        nn.init.normal_(self.query_tokens, std=self.qformer.config.initializer_range)

        # Tokens the tokenizer lacked are added; rows only for ids past the embedding's spare rows.
        self.llm_tokenizer, added_tokens = prepare_tokenizer(tokenizer or llm_model, image_token)
        self.llm_model = self._build_llm(llm_model, llm_config, llm_precision)
        if llm_grad_checkpoint:
            # Non-reentrant: gradients reach the projection through the LLM's inputs even when every
            # LLM weight is frozen, and dropout replays the same mask in the recomputation.
            kwargs = {"use_reentrant": False}
            if hasattr(self.llm_model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                self.llm_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.llm_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.llm_proj = nn.Linear(qformer_width, self.llm_model.config.hidden_size)

        self.prompt = ChatPrompt(self.llm_tokenizer, system_prompt, image_token, num_query_token, max_txt_len,
                                 chat_template_kwargs or {})
        self.end_of_turn_id = self.prompt.end_of_turn_id  # <|im_end|>, <|eot_id|>, <end_of_turn>, ...
        self.pad_id = self.llm_tokenizer.pad_token_id  # prepare_tokenizer guarantees one

        self._apply_freezing(freeze_vit, unfreeze_pos_embed, freeze_qformer, freeze_queries, freeze_proj,
                             freeze_llm, get_lora)
        if get_lora:
            targets = lora_target_names(self.llm_model) if lora_target_modules is None else lora_target_modules
            self.llm_model = add_lora(self.llm_model, lora_r, lora_alpha, lora_dropout, targets)
        new_chatml = [t for t in added_tokens if t in CHATML_TOKENS]
        if freeze_llm and new_chatml:
            # A frozen LLM never saw these tokens: without trained rows the chat format means nothing.
            logger.warning("the tokenizer lacked %s: their embedding and output rows train (only those rows)",
                           ", ".join(new_chatml))
            train_token_rows(base_llm(self.llm_model), self.llm_tokenizer.convert_tokens_to_ids(new_chatml))
        if llm_grad_checkpoint:
            self.train(self.training)  # freezing put the LLM's layers in eval: checkpointing follows the model

    @classmethod
    def config_problems(cls, section: dict[str, Any]) -> list[str]:
        """What the constructor would refuse, found before anything is built (same rules as below)."""
        problems = []
        clashes = sorted(k for k in (section.get("vit") or {}) if k in VIT_KEYS_SET_AT_TOP_LEVEL)
        problems += [f"model.vit.{k}: set it with model.{VIT_KEYS_SET_AT_TOP_LEVEL[k]}, not under vit" for k in clashes]
        if section.get("get_lora") and not section.get("freeze_llm", True):
            problems.append("model.get_lora: true trains only the LoRA adapters, so it needs model.freeze_llm: true")
        if not section.get("tokenizer") and not section.get("llm_model"):
            problems.append("model.tokenizer: required when model.llm_model is null (a local tokenizer folder)")
        if not section.get("llm_model"):
            problems += llm_config_problems(section.get("llm_config"))
        return problems

    @classmethod
    def prompt_from_config(cls, section: Mapping[str, Any]) -> ChatPrompt:
        """The prompt a ``model:`` section builds, from its tokenizer alone, without any weights
        (``lavis_ds.show_sample``); the same tokens as the model's own ``prompt``."""
        args = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
        args.update((key, value) for key, value in section.items() if key in args)
        tokenizer, _ = prepare_tokenizer(args["tokenizer"] or args["llm_model"], args["image_token"])
        return ChatPrompt(tokenizer, args["system_prompt"], args["image_token"], args["num_query_token"],
                          args["max_txt_len"], args["chat_template_kwargs"] or {})

    def repeated_blocks(self) -> list[nn.Module]:
        """The transformer blocks of the three towers (ViT blocks, Q-Former layers, LLM decoder layers): the
        units a sharding engine gathers one at a time. What is left (embeddings, norms, heads, queries,
        projection) belongs to the model as a whole."""
        return [*self.visual_encoder.blocks, *self.qformer.encoder.layer, *decoder_layers(base_llm(self.llm_model))]

    def train(self, mode: bool = True) -> "Blip2Qwen":
        super().train(mode)
        if self.llm_grad_checkpoint:
            # Transformers checkpoints a decoder layer only while that layer is in training mode, and a
            # frozen LLM stays in eval. The layers' own flag follows the model; their submodules (the
            # attention's dropout) keep eval, so a frozen LLM still adds no noise.
            for layer in decoder_layers(base_llm(self.llm_model)):
                layer.training = mode
        return self

    # ----------------------------------------------------------------- building
    @staticmethod
    def _build_vit(vit_model: str, vit: dict[str, Any] | None, image_size: int, drop_path_rate: float,
                   use_grad_checkpoint: bool, vit_precision: str, vit_pretrained: str | None) -> EvaViT:
        overrides = dict(vit or {})
        clashes = sorted(k for k in overrides if k in VIT_KEYS_SET_AT_TOP_LEVEL)
        if clashes:
            raise ValueError("set these with their top-level model keys, not under `vit:`: " +
                             ", ".join(f"vit.{k} -> {VIT_KEYS_SET_AT_TOP_LEVEL[k]}" for k in clashes))
        cfg = EvaViT.default_config(vit_model)
        cfg.update(overrides)
        cfg.update(img_size=image_size, drop_path_rate=drop_path_rate,
                   use_grad_checkpoint=use_grad_checkpoint, precision=vit_precision,
                   load_pretrained=vit_pretrained is not None, pretrained=vit_pretrained)
        return EvaViT.from_config(cfg)

    def load_from_pretrained(self, path: str) -> None:
        """Load a BLIP-2 checkpoint (``pretrained``): a LAVIS ``.pth`` or a Hugging Face BLIP-2 folder.

        Sets ``ln_vision``, ``qformer``, ``query_tokens`` and, if the file has them, the ViT.
        See ``lavis_ds.models.pretrained`` for the key mapping and the keys skipped on purpose.
        """
        load_blip2(self, path, vit_loaded=self.vit_pretrained is not None)

    def _build_llm(self, path: str | None, config: dict[str, Any] | None, precision: str) -> nn.Module:
        """The LLM with a row for every token id, placed as the runner building this model asks (whole,
        partitioned from the start, or empty until process 0 sends its shards: ``lavis_ds.models.llm_placement``)."""
        if path is not None and config:
            logger.info("llm_model is set, so llm_config is ignored: the architecture comes from %s", path)
        architecture = None
        if path is None:
            architecture = llm_config(config or {}, vocab_size=num_token_ids(self.llm_tokenizer))
        dtype = None if precision == "auto" else DTYPES[precision]
        return build_llm(path, architecture, dtype, self.llm_tokenizer)

    def _apply_freezing(self, freeze_vit: bool, unfreeze_pos_embed: bool, freeze_qformer: bool,
                        freeze_queries: bool, freeze_proj: bool, freeze_llm: bool, get_lora: bool) -> None:
        if freeze_vit:
            self.freeze_module("visual_encoder")
            if unfreeze_pos_embed:
                self.visual_encoder.pos_embed.requires_grad_(True)
        elif unfreeze_pos_embed:
            logger.info("unfreeze_pos_embed has no effect: the whole ViT trains (freeze_vit=false)")
        if freeze_qformer:
            self.freeze_module("qformer")
            self.freeze_module("ln_vision")
        if freeze_queries:
            self.query_tokens.requires_grad_(False)
        if freeze_proj:
            self.freeze_module("llm_proj")
        if get_lora and not freeze_llm:
            raise ValueError("get_lora=true trains only the LoRA adapters, so it needs freeze_llm=true")
        if freeze_llm and not get_lora:
            self.freeze_module("llm_model")
        # With LoRA, peft freezes the base weights itself, and the LLM keeps train mode for LoRA dropout.

    def merge_lora(self) -> PreTrainedModel:
        """Turn the LLM into a plain transformers model (``Qwen2ForCausalLM``, ...) with everything trained inside it
        folded in; for export.

        LoRA adapters are merged into the base weights (peft ``merge_and_unload``) and
        trained token rows (ChatML tokens the tokenizer lacked) are written into the
        embedding and output matrices. The plain model replaces ``self.llm_model`` (this
        model keeps working, with the same outputs) and is returned: ``save_pretrained``
        it next to ``self.llm_tokenizer.save_pretrained`` and ``from_pretrained`` reads
        both back. Without LoRA or token rows it returns the LLM unchanged.

        Call it on a model outside the training engine whose trained weights are loaded
        (an engine's partitioned parameters are refused).
        """
        self.llm_model = merge_llm(self.llm_model)
        return self.llm_model

    def save_run_files(self, output_dir: str | Path) -> None:
        """Write ``output_dir/tokenizer``: the tokenizer as used, added tokens included, for export and inference."""
        self.llm_tokenizer.save_pretrained(Path(output_dir) / "tokenizer")

    # ----------------------------------------------------------------- forward
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """``image [B, 3, H, W]`` -> projected queries ``[B, num_query_token, llm_hidden]`` in the LLM embedding dtype."""
        features = self.ln_vision(self.visual_encoder(image))
        queries = self.query_tokens.expand(features.shape[0], -1, -1)
        mask = torch.ones(features.shape[:-1], dtype=torch.long, device=features.device)
        # The HF Q-Former casts queries and features to its own dtype.
        query_out = self.qformer(query_embeds=queries, encoder_hidden_states=features,
                                 encoder_attention_mask=mask).last_hidden_state
        projected = self.llm_proj(query_out.to(self.llm_proj.weight.dtype))
        return projected.to(self._embedding_dtype())

    def image_embeds(self, image: torch.Tensor | None, dummy: bool) -> torch.Tensor:
        """Projected queries of every image of a batch, ``[N, num_query_token, llm_hidden]`` (``image`` is the
        flat ``[N, 3, H, W]`` of all samples' images in order; the vision tower runs once on it).

        A batch with no image (text-only samples only) gives ``[0, ...]``, or with ``dummy`` the features of
        one blank image, which the caller adds to its embeddings times zero (``forward``). Why run the towers
        for nothing: ZeRO-3 and FSDP gather a module's parameters when it runs, as a collective, so every rank
        must run the same modules in each forward or the ranks wait for each other forever; and the trainable
        parts (projection, queries) then get a gradient - zero - on every rank, as the engines' gradient
        reduction expects. Skipping the towers only where no rank has an image would need a collective per
        micro-batch; the blank image costs one image's tower pass, only in image-free micro-batches.
        """
        if image is not None and image.shape[0]:
            return self.encode_image(image)
        device = self.llm_proj.weight.device if image is None else image.device
        if not dummy:
            shape = (0, self.query_tokens.shape[1], self.llm_proj.out_features)
            return torch.zeros(shape, device=device, dtype=self._embedding_dtype())
        blank = torch.zeros((1, 3, self.image_size, self.image_size), device=device)
        return self.encode_image(blank)

    PACKS = True  # prepare_batch(samples, pack_to=N) packs samples into rows (lavis_ds.models.packing)

    def prepare_batch(self, samples: dict[str, Any], pack_to: int | None = None) -> dict[str, Any]:
        """The prompts rendered and tokenized on the host: ``input_ids``, ``attention_mask``, ``labels`` added.

        ``pack_to``: lay the samples end to end in rows of at most that many tokens instead of padding each
        (``position_ids``, per-sample lengths and the packed ``order`` added; see ``models.packing``)."""
        if "labels" in samples:
            return samples
        examples = [self.prompt.training_example(ins, out, n) for ins, out, n in
                    zip(samples["instruction"], samples["output"], image_counts(samples), strict=True)]
        if pack_to is not None:
            return {**samples, **pack(examples, pack_to, self.pad_id, IGNORE_INDEX)}
        input_ids, attention_mask = pad_batch([ids for ids, _ in examples], self.pad_id, side="right")
        labels, _ = pad_batch([lab for _, lab in examples], IGNORE_INDEX, side="right")
        return {**samples, "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def supervised_tokens(self, samples: dict[str, Any]) -> int:
        """The answer tokens (and end-of-turn tokens) the loss of ``forward`` sums over: labels[:, 1:] supervised."""
        return int((samples["labels"][:, 1:] != IGNORE_INDEX).sum())

    def flop_model(self) -> FlopModel:
        """Training FLOPs per sample by part, for the parameters that train now (``lavis_ds.models.flops``)."""
        return flop_model(self)

    def forward(self, samples: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Mean cross-entropy over the supervised tokens of the micro-batch.

        Returns:
            ``loss`` (fp32 scalar to backpropagate), ``loss_sum`` (the summed token losses, also
            differentiable: the runner divides it by the supervised tokens of the whole step under
            ``run.loss_reduction: tokens``) and ``num_tokens`` (supervised tokens).
        """
        samples = self.prepare_batch(samples)
        image = samples.get("image")
        device = self.llm_proj.weight.device if image is None else image.device
        input_ids, labels = samples["input_ids"].to(device), samples["labels"].to(device)
        if "position_ids" in samples:  # packed: each sample's images in the order the samples were laid out
            image = None if image is None else image[_packed_image_order(samples).to(device)]
            layout = {"position_ids": samples["position_ids"].to(device)}
        else:
            layout = {"attention_mask": samples["attention_mask"].to(device)}

        image_embeds = self.image_embeds(image, dummy=True)
        has_images = image is not None and image.shape[0] > 0
        inputs_embeds = self._embed(input_ids, image_embeds if has_images else image_embeds[:0])
        if not has_images:
            # The dummy image's features times zero: in the graph, out of the numbers (see image_embeds).
            inputs_embeds = inputs_embeds + image_embeds.sum() * 0
        logits = self.llm_model(inputs_embeds=inputs_embeds, use_cache=False, **layout).logits
        # Token t predicts token t+1. Only supervised positions are upcast to fp32 (a bf16
        # log-softmax over 150k classes is too coarse; an fp32 copy of every logit is too big).
        targets = labels[:, 1:]
        supervised = targets != IGNORE_INDEX
        token_losses = F.cross_entropy(logits[:, :-1][supervised].float(), targets[supervised], reduction="sum")
        num_tokens = supervised.sum()
        # A batch whose answers were all truncated away gives loss 0 (and zero gradients), not NaN.
        loss = token_losses / num_tokens.clamp(min=1)
        return {"loss": loss, "loss_sum": token_losses, "num_tokens": num_tokens}

    @torch.no_grad()
    def generate(self, samples: dict[str, Any], num_beams: int = 1, max_new_tokens: int = 30,
                 synced_gpus: bool = False, **generate_kwargs: Any) -> list[str]:
        """Answer the last instruction of each sample (greedy or beam search).

        ``samples``: ``image`` (every sample's images in order, ``[N, 3, H, W]``; may be
        empty or left out for text-only samples), ``instruction`` (turns per sample),
        optionally ``output`` (the answers of the earlier turns) and ``num_images`` (images
        per sample, default 1 each; each image has its ``<ImageHere>`` marker in the
        sample's turns, one image may go unmarked). ``synced_gpus`` must be true under
        ZeRO-3 with more than one rank, so that every rank keeps stepping until all have finished.
        Other keyword arguments go to the LLM's ``generate`` (sampling settings, a ``streamer``).
        """
        image = samples.get("image")
        answers = samples.get("output") or [()] * len(samples["instruction"])
        num_images = image_counts(samples)
        prompts = [self.prompt.generation_prompt(ins, out, n)
                   for ins, out, n in zip(samples["instruction"], answers, num_images, strict=True)]
        input_ids, attention_mask = pad_batch(prompts, self.pad_id, side="left")
        device = self.llm_proj.weight.device if image is None else image.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

        # query_tokens belong to this root module: an engine that shards them gathers them for generate
        # (which is not forward) itself. Sharded ranks run the towers even without an image (image_embeds).
        image_embeds = self.image_embeds(image, dummy=synced_gpus)
        inputs_embeds = self._embed(input_ids, image_embeds if sum(num_images) else image_embeds[:0])
        eos = self.stop_token_ids()
        # The placeholder is never a word: generating it would feed its meaningless row back in.
        options = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                       pad_token_id=self.pad_id, synced_gpus=synced_gpus, suppress_tokens=[self.prompt.image_token_id])
        options.update(generate_kwargs)
        # With only inputs_embeds, generate returns just the new tokens.
        new_tokens = self.llm_model.generate(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **options)
        return [text.strip() for text in self.llm_tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def _embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings with each placeholder run replaced by its image's projected queries."""
        embeds = self.llm_model.get_input_embeddings()(input_ids)
        is_image = (input_ids == self.prompt.image_token_id).unsqueeze(-1)
        # masked_scatter fills positions in row-major order: sample by sample, left to right,
        # and ChatPrompt guarantees exactly num_query_token placeholders per image (image_counts
        # checked that the batch holds each sample's images), so the flat images (in sample
        # order, each sample's in marker order) land in their runs; a sample without images has no run.
        return embeds.masked_scatter(is_image, image_embeds.to(embeds.dtype))

    def stop_token_ids(self) -> list[int]:
        """Where generation stops: a turn ends with the template's end-of-turn token (<|im_end|>, <|eot_id|>, ...);
        a base model's tokenizer may name another eos (<|endoftext|>): stop at either."""
        eos = self.llm_tokenizer.eos_token_id
        return list(dict.fromkeys(t for t in (self.end_of_turn_id, eos) if t is not None))

    def _embedding_dtype(self) -> torch.dtype:
        return self.llm_model.get_input_embeddings().weight.dtype


def _packed_image_order(samples: dict[str, Any]) -> torch.Tensor:
    """Indices into the flat image tensor (each sample's images a block, in sample order) that list the images in
    the packed order of their samples."""
    counts = image_counts(samples)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return torch.tensor([starts[i] + k for i in samples["order"] for k in range(counts[i])], dtype=torch.long)


# MiniGPT4Qwen's name for the same architecture (Coobiw/MPP-LLaVA: `arch: minigpt4qwen`).
registry.register_model_alias("minigpt4qwen", "blip2_qwen")
