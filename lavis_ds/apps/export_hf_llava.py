"""LLaVA as a transformers class: a CLIP/SigLIP tower + ``mlp2x_gelu`` + LLM as ``LlavaForConditionalGeneration``.

The parts map module for module, not key for key, because the class builds each part with the same
transformers class lavis_ds holds (``AutoModel.from_config`` of the tower's and the LLM's configs):

    vision_tower.model (CLIPVisionModel / SiglipVisionModel)   -> model.vision_tower
    connector.linear_1, connector.linear_2                      -> model.multi_modal_projector.linear_1 / linear_2
    llm_model's base model (Qwen2Model, ...)                    -> model.language_model
    llm_model's output embeddings                               -> lm_head

``save_pretrained`` then writes whatever key layout the installed transformers writes (hf_keys reads them all).
The tower's feature selection becomes ``vision_feature_layer`` / ``vision_feature_select_strategy``, its
tokens per image ``image_seq_length``, the connector's activation ``projector_hidden_act``.
"""
from __future__ import annotations

import torch
from torch import nn

from lavis_ds.models.llm import base_llm
from lavis_ds.models.llm_placement import empty_weights

# ACT2FN names tried for a connector that does not record its activation's name.
COMMON_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "quick_gelu", "silu", "relu")


def projector_act_name(connector: nn.Module) -> str | None:
    """The ACT2FN name of the connector's activation (the ``projector_hidden_act`` it was built with)."""
    from transformers.activations import ACT2FN

    name = getattr(connector, "projector_hidden_act", None)
    if name is not None:
        return name
    # A connector that does not record its name: the common ACT2FN entry that builds the same module.
    act = connector.act
    return next((n for n in COMMON_ACTIVATIONS if type(ACT2FN[n]) is type(act) and repr(ACT2FN[n]) == repr(act)), None)


def llava_config(model: nn.Module, dtype: torch.dtype):
    """The LlavaConfig of a composed clip/siglip + mlp2x_gelu model (checked by export_hf_checks)."""
    from transformers import LlavaConfig

    tower, connector, llm = model.vision_tower, model.connector, base_llm(model.llm_model)
    # generate reads its stop and pad ids from the generation config built from text_config too.
    text = llm.config.to_dict() | {"eos_token_id": model.stop_token_ids(), "pad_token_id": model.pad_id}
    config = LlavaConfig(vision_config=tower.model.config.to_dict(), text_config=text,
                         image_token_index=model.prompt.image_token_id, image_seq_length=tower.num_tokens,
                         projector_hidden_act=projector_act_name(connector),
                         vision_feature_select_strategy=tower.strategy, vision_feature_layer=tower.layers,
                         multimodal_projector_bias=connector.linear_1.bias is not None,
                         tie_word_embeddings=bool(llm.config.tie_word_embeddings))
    config.dtype = dtype
    for sub in (config.vision_config, config.text_config):
        sub.dtype = dtype
    return config


def to_hf_model(model: nn.Module, dtype: torch.dtype):
    """A LlavaForConditionalGeneration holding ``model``'s weights in ``dtype``, every parameter accounted for."""
    from transformers import LlavaForConditionalGeneration

    with empty_weights():  # parameters on the meta device: every one is assigned from `model` below
        hf_model = LlavaForConditionalGeneration(llava_config(model, dtype))
    llm = base_llm(model.llm_model)
    decoder = getattr(llm, llm.base_model_prefix)
    connector = model.connector
    pairs = [(hf_model.model.vision_tower, model.vision_tower.model),
             (hf_model.model.multi_modal_projector.linear_1, connector.linear_1),
             (hf_model.model.multi_modal_projector.linear_2, connector.linear_2),
             (hf_model.model.language_model, decoder),
             (hf_model.lm_head, llm.get_output_embeddings())]
    for theirs, ours in pairs:
        state = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in ours.state_dict().items()}
        theirs.load_state_dict(state, strict=True, assign=True)  # strict: the classes agree key for key
    if hf_model.config.tie_word_embeddings:
        hf_model.tie_weights()
    left = [name for name, p in hf_model.named_parameters() if p.is_meta]
    if left:  # the module pairs above and transformers' class disagree: a bug here, not the user's
        raise RuntimeError(f"LlavaForConditionalGeneration parameters left unassigned: {left[:8]}")
    return hf_model.eval()
