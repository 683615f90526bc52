"""The architecture-neutral half of a vision-LLM: the chat LLM, its prompt, LoRA, export, and (from its base,
``lavis_ds.models.vision_llm_forward``) the batch, the splice, loss and generate.

An architecture (``Blip2Qwen``, ...) subclasses ``VisionLLM`` and names its parts' defaults and presets; where its
image path differs from a fixed-size tower's, it names its ``IMAGE_PATH`` (``lavis_ds.models.image_path``), the class
of the part ``model.image_path``: ``encode(images, samples)`` (``[N, tokens_per_image, llm_hidden]`` for
``images [N, 3, H, W]``, or the flat ``[sum of counts, llm_hidden]`` when the count depends on the image; under
packing the images arrive in packed order), the splice into the LLM's embeddings, ``blocks()`` for a sharding
engine, the FLOPs; and by its ``LAYOUT`` the part ``model.images`` (``lavis_ds.models.image_layout``:
``tokens_per_image``, ``image_size``, the one count the prompt's placeholders and the splice both follow, the
visuals M-RoPE numbers, the blank image). ``model.batch`` (``vision_llm_batch.HostBatch``) is ``prepare_batch``'s
host side.

Its constructor builds the parts from their sections, in one step, in the order their random initialisations
draw (and their parameters, and the engines' flat optimizer states, are registered): the tower, then the LLM
(``model.llm``, a ``lavis_ds.models.chat_llm.ChatLLM``, its causal LM registered as ``llm_model``; built with the
random number generator forked from where it stood after the tower, then frozen, LoRA-wrapped), then the connector
(projecting to the LLM's width). The connector is built before the LLM part, so its initialisation draws before
LoRA's, as it always has: a seed gives the same weights. The modules register as tower, LLM, connector.
An architecture with keys of its own for the parts (``blip2_qwen``) translates them into the two sections and
passes them on.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from torch import nn
from transformers import PreTrainedModel

from lavis_ds.common.registry import connectors, vision_towers
from lavis_ds.common.schema import fields_of
from lavis_ds.models.chat_llm import ChatLLM, PromptLayout, llm_width
from lavis_ds.models.image_path import ImagePath
from lavis_ds.models.flops import FlopModel
from lavis_ds.models.llm import prepare_tokenizer
from lavis_ds.models.llm_families import llm_config_problems
from lavis_ds.models.parts import build_part, check_layouts, given_part_sections
from lavis_ds.models.prompt import ChatPrompt
from lavis_ds.models.vision_llm_batch import HostBatch
from lavis_ds.models.vision_llm_forward import VisionLLMForward

logger = logging.getLogger(__name__)


class VisionLLM(VisionLLMForward):
    """Image features spliced into a chat LLM at the image placeholder tokens; subclasses give the image path.

    This class builds the model and answers the config's questions; what it computes on a batch (the splice, the
    loss, generation) is its base's (``lavis_ds.models.vision_llm_forward``)."""

    # Keys of a `model:` section naming local files or folders the model reads, checked before any rank loads them.
    FILE_KEYS: tuple[str, ...] = ("tokenizer", "llm_model")
    # The state_dict prefix of the LLM: what merge_lora turns into a plain transformers model (export writes it as a
    # Hugging Face folder and the rest beside it).
    LLM_PREFIX = "llm_model."
    # Parameters built from the LLM's width (the connector): export writes them even when frozen, so that a model
    # rebuilt on the merged LLM never depends on how the LLM was built. Subclasses name theirs.
    CONNECTOR_PREFIXES: tuple[str, ...] = ()
    # The tokens the family's chat template writes around each image's placeholders (Qwen-VL's vision start and end;
    # added to a tokenizer that lacks them), or None: the placeholders stand inside the data's <Img>...</Img>.
    IMAGE_SPAN: tuple[str, str] | None = None
    # Special tokens the prompt may write besides the image token (the span's; Qwen-VL's video placeholder too):
    # added to a tokenizer that lacks them.
    PROMPT_TOKENS: tuple[str, ...] = ()
    # The placeholder token of a video (a visual with its own time spacing, image_tokens.video_flags) where the
    # family's processor writes one of its own (Qwen-VL's <|video_pad|>); None: a video's placeholders are images'.
    VIDEO_TOKEN: str | None = None
    # Frames per temporal patch where the family's processor writes a video frame group by frame group, each after
    # its time (Qwen3-VL: models.frame_groups); None: a video is one run of placeholders.
    VIDEO_FRAME_GROUPS: int | None = None
    # The architecture's image path (tower -> connector -> splice) and, by its LAYOUT, how its images become LLM
    # tokens on the host: both made from the tower and the connector.
    IMAGE_PATH: type[ImagePath] = ImagePath
    # The attributes the constructor sets are declared by the base (the model contract reads the declarations).

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
        self.loss_chunks = loss_chunks
        tower_section, connector_section = given_part_sections(type(self), {"vision_tower": vision_tower,
                                                                            "connector": connector})
        check_layouts(type(self), tower_section, connector_section)
        tower = build_part(vision_towers, tower_section, "model.vision_tower")
        # A random-init LLM (tests, demos) is initialised from where it always was: right after the tower.
        llm_random_state = torch.random.get_rng_state()
        width = llm_width(llm_model, llm_config)
        part = build_part(connectors, connector_section, "model.connector", vision_width=tower.num_features,
                          llm_width=width)
        # A flat-feature tower has no count per image: the layout's tokens_for_image says it per image size.
        tokens_per_image = None if tower.num_tokens is None else part.tokens_per_image(tower.num_tokens)
        self.images = self.IMAGE_PATH.LAYOUT(tower, tokens_per_image, type(self).__name__)
        layout = PromptLayout(self.IMAGE_SPAN, self.PROMPT_TOKENS, self.VIDEO_TOKEN, self.VIDEO_FRAME_GROUPS)
        self.llm = ChatLLM(
            tokens_per_image=tokens_per_image, layout=layout, random_state=llm_random_state,
            llm_model=llm_model, llm_config=llm_config,
            llm_precision=llm_precision, tokenizer=tokenizer, freeze_llm=freeze_llm,
            llm_grad_checkpoint=llm_grad_checkpoint, get_lora=get_lora, lora_r=lora_r, lora_alpha=lora_alpha,
            lora_dropout=lora_dropout, lora_target_modules=lora_target_modules, max_txt_len=max_txt_len,
            system_prompt=system_prompt, record_system_prompt=record_system_prompt, image_token=image_token,
            chat_template_kwargs=chat_template_kwargs)
        if self.llm.config.hidden_size != width:
            raise RuntimeError(f"lavis_ds: the LLM built from {llm_model or 'model.llm_config'} is "
                               f"{self.llm.config.hidden_size} wide, its config read {width}: the connector would "
                               "project to the wrong width")
        # Registered in this order (tower, LLM, connector): the order of the parameters that checkpoints and the
        # engines' flat optimizer states hold.
        self.vision_tower = tower
        self.llm_model = self.llm.model
        self.connector = part
        self.image_path = self.IMAGE_PATH(tower, part, self.images, self.llm)
        self.batch = HostBatch(self.llm, self.images, self.image_path.host_inputs)
        if self.llm.eval_only:  # frozen by the LLM part already (its trainable token rows keep their gradient)
            self._eval_only = self._eval_only | {"llm_model"}
        if llm_grad_checkpoint:
            self.train(self.training)  # freezing put the LLM's layers in eval: checkpointing follows the model

    # ----------------------------------------------------------------- what the config asks of the class
    @classmethod
    def settings_of(cls, section: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's arguments a ``model:`` section gives, defaults filled in (no weights read)."""
        args = {name: default for name, (_, default) in fields_of(cls).items()}
        args.update((key, value) for key, value in section.items() if key in args)
        return args

    @classmethod
    def tokens_per_image_of(cls, section: Mapping[str, Any]) -> int:
        """Image placeholders per image in the prompt that ``section`` builds. Subclasses say."""
        raise NotImplementedError(f"{cls.__name__} does not say how many tokens an image takes")

    @classmethod
    def image_size_of(cls, section: Mapping[str, Any]) -> int | None:
        """The image side the vision tower of ``section`` takes: ``image_size`` (subclasses whose tower fixes it
        say otherwise)."""
        return cls.settings_of(section).get("image_size")

    @classmethod
    def text_length_of(cls, section: Mapping[str, Any]) -> int:
        """The longest training sequence in tokens (the model truncates there): ``max_txt_len``."""
        return cls.settings_of(section)["max_txt_len"]

    @classmethod
    def config_problems(cls, section: Mapping[str, Any]) -> list[str]:
        """What the constructor would refuse, found before anything is built (same rules as the build)."""
        problems = []
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
        args = cls.settings_of(section)
        tokenizer, _ = prepare_tokenizer(args["tokenizer"] or args["llm_model"], args["image_token"],
                                         cls.PROMPT_TOKENS)
        return ChatPrompt(tokenizer, args["system_prompt"], args["image_token"], cls.tokens_per_image_of(section),
                          args["max_txt_len"], args["chat_template_kwargs"] or {},
                          record_system_prompt=args["record_system_prompt"], image_span=cls.IMAGE_SPAN,
                          video_token=cls.VIDEO_TOKEN, video_frame_groups=cls.VIDEO_FRAME_GROUPS)

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
        return self.image_path.flop_model(self.llm_model, not self._head_at_supervised_positions())

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

    @staticmethod
    def merged_llm_settings(folder: str) -> dict[str, Any]:
        """The ``model:`` keys that make this model load the merged LLM saved in ``folder`` (``merge_lora``,
        ``save_pretrained`` with the tokenizer) instead of building its own."""
        return {"llm_model": folder, "tokenizer": folder, "llm_config": None, "llm_precision": "auto",
                "get_lora": False, "freeze_llm": True}

    def save_run_files(self, output_dir: str | Path) -> None:
        """Write ``output_dir/tokenizer``: the tokenizer as used, added tokens included (``llm.save``)."""
        self.llm.save(output_dir)
