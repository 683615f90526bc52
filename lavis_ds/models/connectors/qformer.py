"""BLIP-2's and InstructBLIP's connectors: ``ln_vision`` -> Q-Former with learned queries -> linear projection.

Attribute names are BLIP-2's (``ln_vision``, ``qformer``, ``query_tokens``, ``llm_proj``), so LAVIS and
Hugging Face weights map through ``models.hf_keys`` (``qformer_from_lavis`` / ``qformer_from_hf``).
``instruct_qformer`` also feeds the instruction's BERT tokens into the Q-Former beside the queries
(attention mask ``cat(query_atts, text_atts)``) and projects only the query outputs, as transformers'
``InstructBlipForConditionalGeneration.get_image_features`` does.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (Blip2QFormerConfig, Blip2QFormerModel, InstructBlipQFormerConfig,
                          InstructBlipQFormerModel)

from lavis_ds.common import registry as reg
from lavis_ds.models.connectors.base import Connector
from lavis_ds.models.connectors.instruction import image_instructions, load_qformer_tokenizer, tokenize_instructions
from lavis_ds.models.flops import Flops, Tally
from lavis_ds.models.flops import qformer as qformer_flops
from lavis_ds.models.parts import PartError

logger = logging.getLogger(__name__)


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the input and parameter dtypes, returned in the input dtype.

    LAVIS's ``ln_vision`` does the same for fp16; statistics over 1408 channels in half precision lose too
    much. Being a module (not a functional call) lets ZeRO-3 gather it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


@reg.connectors.register("qformer")
class QFormerConnector(Connector):
    """BLIP-2: ``num_query_token`` learned queries cross-attend to the normalised tower features."""

    CONFIG_CLASS, MODEL_CLASS = Blip2QFormerConfig, Blip2QFormerModel

    def __init__(self, *, vision_width: int, llm_width: int, num_query_token: int = 32,
                 qformer: dict[str, Any] | None = None, freeze_qformer: bool = False, freeze_queries: bool = False,
                 freeze_proj: bool = False, ln_vision_eps: float = 1e-5):
        """
        Args:
            vision_width: The tower's ``num_features`` (given by the architecture).
            llm_width: The LLM's hidden size (given by the architecture).
            num_query_token: Learned queries = image tokens the LLM sees per image.
            qformer: Q-Former config arguments; defaults are BLIP-2's (768 wide, 12 layers, cross-attention
                every 2nd). ``encoder_hidden_size`` is the tower width.
            freeze_qformer: Freeze the Q-Former and ``ln_vision`` (BLIP-2's recipe freezes them).
            freeze_queries: Freeze the query tokens.
            freeze_proj: Freeze the projection into the LLM.
            ln_vision_eps: Epsilon of ``ln_vision``: LAVIS's is torch's default 1e-5; transformers' BLIP-2 and
                InstructBLIP use the vision config's ``layer_norm_eps`` (1e-6) for it (``post_layernorm``).
        """
        super().__init__(vision_width=vision_width, llm_width=llm_width)
        arguments = dict(qformer or {})
        if arguments.setdefault("encoder_hidden_size", vision_width) != vision_width:
            raise PartError(f"connector.qformer.encoder_hidden_size: {arguments['encoder_hidden_size']} must equal "
                            f"the tower width {vision_width} (or be left out)")
        self.ln_vision = FP32LayerNorm(vision_width, eps=ln_vision_eps)
        self.qformer = self.MODEL_CLASS(self.CONFIG_CLASS(**arguments))
        width = self.qformer.config.hidden_size
        self.query_tokens = nn.Parameter(torch.zeros(1, num_query_token, width))
        nn.init.normal_(self.query_tokens, std=self.qformer.config.initializer_range)  # as BLIP-2 (BERT init)
        self.llm_proj = nn.Linear(width, llm_width)
        for name, frozen in (("qformer", freeze_qformer), ("ln_vision", freeze_qformer), ("llm_proj", freeze_proj)):
            if frozen:
                self.freeze_submodule(name)
        if freeze_queries:
            self.query_tokens.requires_grad_(False)

    def tokens_per_image(self, vision_tokens: int) -> int:
        return self.query_tokens.shape[1]

    def blocks(self) -> list[nn.Module]:
        return list(self.qformer.encoder.layer)

    def flops(self, vision_tokens: int, features_grad: bool, text_tokens: int = 0) -> tuple[Flops, bool]:
        """``ln_vision``, the Q-Former and the projection; the instruction's tokens count only where the
        connector reads one (``NEEDS_INSTRUCTION``)."""
        tally = Tally()
        out = qformer_flops(self.qformer, self.query_tokens, self.ln_vision, self.llm_proj, vision_tokens,
                            features_grad, tally, text_tokens if self.NEEDS_INSTRUCTION else 0)
        return tally.flops(), out

    def _features(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.ln_vision(features)
        queries = self.query_tokens.expand(features.shape[0], -1, -1)
        mask = torch.ones(features.shape[:-1], dtype=torch.long, device=features.device)
        return features, queries, mask

    def forward(self, features: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        features, queries, mask = self._features(features)
        out = self.qformer(query_embeds=queries, encoder_hidden_states=features,
                           encoder_attention_mask=mask).last_hidden_state
        return self.llm_proj(out.to(self.llm_proj.weight.dtype))

    def load_pretrained(self, path: str) -> None:
        """The bridge of a LAVIS BLIP-2 / InstructBLIP ``.pth`` or a Hugging Face BLIP-2 / InstructBLIP folder.

        The projection is loaded when the file has one of the right shape (an InstructBLIP file, or a run's
        own); BLIP-2's stage-1 files have none, and a projection into another LLM's width is left as it is."""
        from lavis_ds.models import hf_keys
        from lavis_ds.models.pretrained import (CheckpointError, detect_torch_format, load_checked, load_torch_file,
                                                read_safetensors_file)

        file = Path(path).expanduser()
        if not file.exists():
            raise PartError(f"connector.pretrained: {file} not found")
        instruct = isinstance(self, InstructQFormerConnector)
        if file.is_dir():
            fmt = "Hugging Face BLIP-2 / InstructBLIP folder"
            state, _ = read_safetensors_file(file, lambda key: key.startswith("language_model."))  # the LLM is not read
            ours = hf_keys.qformer_from_hf(state)
        else:  # read whole: InstructBLIP uses the text keys that BLIP-2's reader skips
            fmt, state = detect_torch_format(file, load_torch_file(file))
            ours = hf_keys.qformer_from_lavis(state, instruct)
        own = self.state_dict()
        proj = {k: v for k, v in ours.items() if k.startswith("llm_proj.")}
        if proj and any(v.shape != own[k].shape for k, v in proj.items() if k in own):
            logger.warning("%s: its projection is for an LLM of width %d, not %d: llm_proj keeps its own weights",
                           file, proj["llm_proj.weight"].shape[0], self.llm_width)
            ours = {k: v for k, v in ours.items() if k not in proj}
        expected = [k for k in own if not k.startswith("llm_proj.") or k in ours]
        try:
            load_checked(self, ours, expected, file, fmt)
        except CheckpointError as e:
            raise PartError(str(e)) from None


@reg.connectors.register("instruct_qformer")
class InstructQFormerConnector(QFormerConnector):
    """InstructBLIP: the instruction's BERT tokens enter the Q-Former beside the queries."""

    CONFIG_CLASS, MODEL_CLASS = InstructBlipQFormerConfig, InstructBlipQFormerModel
    NEEDS_INSTRUCTION = True

    def __init__(self, *, qformer_tokenizer: str | None = None, max_instruction_len: int = 128, **kwargs: Any):
        """
        Args:
            qformer_tokenizer: Local folder of the Q-Former's BERT tokenizer (an InstructBLIP folder's
                ``qformer_tokenizer/``); read when the connector is built from config.
            max_instruction_len: Instruction tokens kept per image, truncated on the left (LAVIS's
                ``max_txt_len``, 128).
            kwargs: The ``qformer`` connector's arguments.
        """
        super().__init__(**kwargs)
        self.qformer_tokenizer_path, self.max_instruction_len = qformer_tokenizer, max_instruction_len
        self.tokenizer = None

    def load_files(self) -> None:
        self.tokenizer = load_qformer_tokenizer(self.qformer_tokenizer_path, self.qformer.config.vocab_size)

    def prepare(self, samples: Mapping[str, Any]) -> dict[str, Any]:
        """``qformer_input_ids`` / ``qformer_attention_mask``, one row per image of the batch, in image order."""
        if self.tokenizer is None:
            self.load_files()
        return tokenize_instructions(self.tokenizer, image_instructions(samples), self.max_instruction_len)

    def forward(self, features: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        if not inputs or "qformer_input_ids" not in inputs:
            raise ValueError("instruct_qformer needs the instruction tokens: pass prepare(samples) as inputs")
        features, queries, mask = self._features(features)
        input_ids = inputs["qformer_input_ids"].to(features.device)
        text_mask = inputs.get("qformer_attention_mask")
        text_mask = torch.ones_like(input_ids) if text_mask is None else text_mask.to(features.device)
        attention_mask = torch.cat([torch.ones(queries.shape[:-1], dtype=torch.long, device=features.device),
                                    text_mask], dim=1)
        out = self.qformer(input_ids=input_ids, attention_mask=attention_mask, query_embeds=queries,
                           encoder_hidden_states=features, encoder_attention_mask=mask).last_hidden_state
        return self.llm_proj(out[:, :queries.shape[1]].to(self.llm_proj.weight.dtype))
