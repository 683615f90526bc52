"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's text models as causal LMs for the LLM slot: the decoder and an output head.

transformers has these decoders (``Qwen2VLTextModel``, ``Qwen2_5_VLTextModel``) only inside the vision-language
classes, which own a vision tower too; lavis_ds composes its own image path, so the LLM slot takes the text model
alone with ``lm_head`` on top, exactly as ``Qwen2VLForConditionalGeneration`` computes its logits
(``lm_head(language_model(...).last_hidden_state)``), under the same parameter names (``model.*``, ``lm_head.*``).
They take M-RoPE positions: ``position_ids [3, B, L]``, or ``[4, B, L]`` with the plain positions in front when
samples are packed (``lavis_ds.models.positions``). ``model.llm_config: {model_type: qwen2_vl_text, ...}`` builds one
(``lavis_ds.models.llm_families.causal_lm_class``).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLPreTrainedModel, Qwen2VLTextModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

from lavis_ds.models.linear_attention import Qwen3_5TextForCausalLM

# Qwen3VLTextModel's DeepStack arguments: the image positions and the features added there after the first layers.
DEEPSTACK_KEYS = ("visual_pos_masks", "deepstack_visual_embeds")


class Qwen2VLTextForCausalLM(Qwen2VLPreTrainedModel, GenerationMixin):
    """``Qwen2VLTextModel`` + ``lm_head``: Qwen2-VL's language model on its own."""

    config: Qwen2VLTextConfig
    config_class = Qwen2VLTextConfig
    TEXT_MODEL: type = Qwen2VLTextModel
    input_modalities = ("text",)
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _no_split_modules = ["Qwen2VLDecoderLayer", "Qwen2_5_VLDecoderLayer", "Qwen3VLTextDecoderLayer"]

    def __init__(self, config: Qwen2VLTextConfig):
        super().__init__(config)
        self.model = self.TEXT_MODEL(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self) -> nn.Module:
        return self.model

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None, **kwargs
                ) -> CausalLMOutputWithPast:
        """The logits of every position (``labels``: transformers' shifted cross-entropy, for its own callers)."""
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


class Qwen2_5_VLTextForCausalLM(Qwen2VLTextForCausalLM):
    """``Qwen2_5_VLTextModel`` + ``lm_head``: Qwen2.5-VL's language model on its own (the same decoder as Qwen2-VL's;
    the families differ in their towers and in how video time enters the positions)."""

    config: Qwen2_5_VLTextConfig
    config_class = Qwen2_5_VLTextConfig
    TEXT_MODEL = Qwen2_5_VLTextModel


class Qwen3VLTextForCausalLM(Qwen2VLTextForCausalLM):
    """``Qwen3VLTextModel`` + ``lm_head``: Qwen3-VL's language model on its own. Its rotary embedding interleaves
    the temporal, height and width frequencies (``mrope_section`` [24, 20, 20]); it takes the DeepStack features
    (``deepstack_visual_embeds`` at ``visual_pos_masks``) as its own arguments and adds them to the hidden states
    after its first decoder layers, exactly as in ``Qwen3VLForConditionalGeneration``."""

    config: Qwen3VLTextConfig
    config_class = Qwen3VLTextConfig
    TEXT_MODEL = Qwen3VLTextModel

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                visual_pos_masks: torch.Tensor | None = None,
                deepstack_visual_embeds: list[torch.Tensor] | None = None, **kwargs) -> CausalLMOutputWithPast:
        """As Qwen2-VL's, with the DeepStack arguments named (generate passes on the arguments a forward names)."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               visual_pos_masks=visual_pos_masks, deepstack_visual_embeds=deepstack_visual_embeds,
                               **kwargs)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, next_sequence_length: int | None = None,
                                      cache=None, attention_mask: torch.LongTensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None,
                                      is_first_iteration: bool | None = False, **kwargs):
        """The DeepStack features go with the prompt only (the first step; later steps are new text tokens), and
        beam search's copies of the prompt get their own copy of them."""
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)
        if not is_first_iteration and inputs.get("cache") is not None:
            for key in DEEPSTACK_KEYS:
                inputs.pop(key, None)
        elif inputs.get("deepstack_visual_embeds") is not None:
            inputs["deepstack_visual_embeds"] = per_row_copies(inputs["visual_pos_masks"],
                                                               inputs["deepstack_visual_embeds"])
        return inputs


def per_row_copies(mask: torch.Tensor, features: list[torch.Tensor]) -> list[torch.Tensor]:
    """``features`` (the image rows of the prompts, prompt by prompt) for ``mask``, whose rows are each prompt
    repeated (beam search expands every input ``num_beams`` times, a list of tensors not): each prompt's rows as
    often as its copies. Unchanged where the mask has one row per prompt."""
    rows = int(features[0].shape[0]) if features else 0
    copies = int(mask.sum()) // rows if rows else 1
    if copies <= 1:
        return features
    counts = mask.sum(-1)[::copies].tolist()  # each prompt's image rows (its copies are consecutive)
    return [torch.cat([chunk for chunk in f.split(counts) for _ in range(copies)]) for f in features]


# The text-only causal LMs lavis_ds adds to AutoModelForCausalLM's, by model_type (llm_families.causal_lm_class).
# Qwen3.5's (lavis_ds.models.linear_attention) is transformers' with Gated-DeltaNet layers that take packed boundaries.
TEXT_CAUSAL_LMS: dict[str, type] = {"qwen2_vl_text": Qwen2VLTextForCausalLM,
                                    "qwen2_5_vl_text": Qwen2_5_VLTextForCausalLM,
                                    "qwen3_vl_text": Qwen3VLTextForCausalLM,
                                    "qwen3_5_text": Qwen3_5TextForCausalLM}
