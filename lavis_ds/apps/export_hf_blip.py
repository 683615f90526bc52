"""BLIP-2 and InstructBLIP as transformers classes: EVA ViT + ``ln_vision`` + Q-Former + queries + projection + LLM.

Both classes hold the same parts under the same names (``vision_model`` with ``post_layernorm``, ``qformer``,
``query_tokens``, ``language_projection``, ``language_model`` built by ``AutoModelForCausalLM``);
InstructBLIP's Q-Former also embeds the instruction's BERT tokens. :class:`BlipParts` names those parts in a
lavis_ds model, whichever way the model holds them: ``blip2_qwen``'s flat attributes, or a composed
architecture's ``vision_tower`` (``eva_vit_g``) and ``connector`` (``qformer`` / ``instruct_qformer``).

The key mapping (ours -> Hugging Face) is the inverse of the one ``lavis_ds.models.pretrained`` reads Hugging
Face BLIP-2 folders with: the timm EVA ViT becomes ``vision_model`` (its q/v biases one ``qkv.bias`` with a zero
k part), ``ln_vision`` its ``post_layernorm``; ``qformer`` and ``query_tokens`` keep their names (lavis_ds uses
transformers' Q-Formers); ``llm_proj`` becomes ``language_projection``, the LLM ``language_model``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from lavis_ds.models.llm_placement import empty_weights
from lavis_ds.models.pretrained import _rename_key  # one renamer for both directions

# torch GELU flavours -> the names transformers' ACT2FN knows them by.
GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
# Ours -> Hugging Face, the inverse of pretrained.HF_RENAMES (a test checks that they agree). The q/v
# biases are not renamed but fused into qkv.bias, see `vision_state_dict`.
VISION_RENAMES = (
    (r"cls_token$", "embeddings.class_embedding"),
    (r"pos_embed$", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"blocks\.(\d+)\.norm([12])\.", r"encoder.layers.\1.layer_norm\2."),
    (r"blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
)


@dataclass(frozen=True)
class BlipParts:
    """A BLIP-family model's parts, and the names its messages give them (``visual_encoder`` or
    ``vision_tower.vit``, ...)."""

    vit: nn.Module
    ln_vision: nn.Module
    qformer: nn.Module
    query_tokens: nn.Parameter
    llm_proj: nn.Linear
    llm: nn.Module
    vit_name: str = "visual_encoder"
    ln_name: str = "ln_vision"
    proj_name: str = "llm_proj"

    @classmethod
    def of(cls, model: nn.Module) -> "BlipParts":
        """The parts of ``blip2_qwen`` (flat attributes) or of a composed eva_vit_g + Q-Former architecture."""
        if hasattr(model, "vision_tower"):
            tower, connector = model.vision_tower, model.connector
            return cls(tower.vit, connector.ln_vision, connector.qformer, connector.query_tokens, connector.llm_proj,
                       model.llm_model, "vision_tower.vit", "connector.ln_vision", "connector.llm_proj")
        return cls(model.visual_encoder, model.ln_vision, model.qformer, model.query_tokens, model.llm_proj,
                   model.llm_model)


def activation_name(act: nn.Module) -> str | None:
    """The ACT2FN name of a torch GELU, else None."""
    return GELU_ACTIVATIONS.get(act.approximate) if type(act) is nn.GELU else None


def vision_config(vit: nn.Module) -> dict:
    """Blip2VisionConfig / InstructBlipVisionConfig arguments of a timm EVA ViT (checked by ``vit_problems``)."""
    block = vit.blocks[0]
    return {"hidden_size": vit.embed_dim, "intermediate_size": block.mlp.fc1.out_features,
            "num_hidden_layers": len(vit.blocks), "num_attention_heads": block.attn.num_heads,
            "image_size": vit.patch_embed.img_size[0], "patch_size": vit.patch_embed.patch_size[0],
            "hidden_act": activation_name(block.mlp.act), "layer_norm_eps": block.norm1.eps,
            "qkv_bias": block.attn.q_bias is not None}


def blip_config(model: nn.Module, dtype: torch.dtype, instruct: bool):
    """The Blip2Config (or InstructBlipConfig) of ``model``: the LLM's own config as text_config, the image token's
    id as image_token_index."""
    from transformers import Blip2Config, InstructBlipConfig

    parts = BlipParts.of(model)
    # The LLM's generate reads its stop and pad ids from text_config (see export_hf_processor.generation_config).
    text = parts.llm.config.to_dict() | {"eos_token_id": model.stop_token_ids(), "pad_token_id": model.pad_id}
    config_class = InstructBlipConfig if instruct else Blip2Config
    config = config_class(vision_config=vision_config(parts.vit), qformer_config=parts.qformer.config.to_dict(),
                          text_config=text, num_query_tokens=parts.query_tokens.shape[1],
                          image_token_index=model.prompt.image_token_id)
    config.dtype = dtype
    for sub in (config.vision_config, config.qformer_config, config.text_config):
        sub.dtype = dtype
    return config


def to_hf_model(model: nn.Module, dtype: torch.dtype, instruct: bool = False):
    """A Blip2ForConditionalGeneration (``instruct``: InstructBlipForConditionalGeneration) holding ``model``'s
    weights in ``dtype``, every key accounted for."""
    from transformers import Blip2ForConditionalGeneration, InstructBlipForConditionalGeneration

    hf_class = InstructBlipForConditionalGeneration if instruct else Blip2ForConditionalGeneration
    # Parameters on the meta device: they come from `model`, so no memory and no time for a random init.
    # Buffers stay real: rotary tables are computed at construction and are in no state dict.
    with empty_weights():
        hf_model = hf_class(blip_config(model, dtype, instruct))
    state = {name: tensor.detach().to(dtype) for name, tensor in hf_state_dict(BlipParts.of(model)).items()}
    expected = set(hf_model.state_dict())
    missing, unknown = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unknown:  # the mapping and transformers' class disagree: a bug here, not the user's
        raise RuntimeError(f"key mapping to {hf_class.__name__}: missing {missing[:8]}, unknown {unknown[:8]}")
    hf_model.load_state_dict(state, strict=True, assign=True)
    hf_model.tie_weights()  # a text_config with tie_word_embeddings shares one matrix again
    return hf_model.eval()


def hf_state_dict(parts: BlipParts) -> dict[str, torch.Tensor]:
    """The parts' weights under Blip2ForConditionalGeneration's (and InstructBLIP's) names."""
    state = {f"vision_model.{k}": v for k, v in vision_state_dict(parts.vit).items()}
    state |= {f"vision_model.post_layernorm.{k}": v for k, v in parts.ln_vision.state_dict().items()}
    # position_ids: a buffer InstructBLIP's Q-Former embeddings hold, in no transformers state dict.
    state |= {f"qformer.{k}": v for k, v in parts.qformer.state_dict().items() if not k.endswith("position_ids")}
    state["query_tokens"] = parts.query_tokens
    state |= {f"language_projection.{k}": v for k, v in parts.llm_proj.state_dict().items()}
    state |= {f"language_model.{k}": v for k, v in parts.llm.state_dict().items()}
    return state


def vision_state_dict(vit: nn.Module) -> dict[str, torch.Tensor]:
    """The EVA ViT's weights under Blip2VisionModel's names (without ``post_layernorm``: that is ln_vision).

    timm keeps EVA's q and v biases as parameters and a zero k bias as a buffer; Blip2Attention has one
    qkv bias of [q, k, v], built the same way, so the three are concatenated in that order.
    """
    state = {}
    for key, value in vit.state_dict().items():
        if re.search(r"\.attn\.[qkv]_bias$", key):
            continue
        new = _rename_key(key, VISION_RENAMES)
        if new == key:
            raise RuntimeError(f"visual_encoder.{key}: no Blip2VisionModel name for it")  # checked layout: a bug
        state[new] = value
    for i, block in enumerate(vit.blocks):
        attn = block.attn
        if attn.q_bias is not None:
            k_bias = attn.k_bias if attn.k_bias is not None else torch.zeros_like(attn.q_bias)
            bias = torch.cat((attn.q_bias, k_bias.to(attn.q_bias.dtype), attn.v_bias))
            state[f"encoder.layers.{i}.self_attn.qkv.bias"] = bias
    return state


def ln_vision_note(parts: BlipParts) -> list[str]:
    """The one difference no weight carries: ``ln_vision``'s eps against the ViT blocks' (one eps in HF's config)."""
    vit_eps, ln_eps = parts.vit.blocks[0].norm1.eps, parts.ln_vision.eps
    if vit_eps == ln_eps:
        return []
    # Blip2VisionConfig has one layer_norm_eps for the blocks and post_layernorm; BLIP-2's ln_vision is torch's
    # default 1e-5, EVA's blocks 1e-6. transformers' script that converted LAVIS's BLIP-2 maps ln_vision onto
    # post_layernorm the same way. Not refused: every LAVIS BLIP-2 model has it.
    return [f"{parts.ln_name}'s LayerNorm eps {ln_eps:g} becomes post_layernorm with the ViT blocks' eps "
            f"{vit_eps:g} (the vision config has one layer_norm_eps): each image feature changes by a factor "
            f"sqrt((v + {ln_eps:g}) / (v + {vit_eps:g})), about {abs(ln_eps - vit_eps) / 2:g} / v relative, v being "
            "its token's feature variance"]
