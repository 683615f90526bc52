"""What of a lavis_ds model transformers' ``Blip2ForConditionalGeneration`` cannot express.

HF's BLIP-2 is one fixed architecture: EVA-ViT-g's layout (class token, absolute position
embedding, pre-norm blocks with a fused qkv whose k bias is zero, a GELU MLP, no layer scale, no
rope, LayerNorms of one eps, then ``post_layernorm``), transformers' Q-Former, a linear projection
and any causal LM that ``AutoModelForCausalLM`` builds from ``text_config``. The checks read the
built modules, not the config, so that a ViT variant added later is judged by what it computes.
Every problem is collected and reported at once.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from lavis_ds.apps.export import ExportError

# torch GELU flavours -> the names transformers' ACT2FN knows them by.
GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
# The image processor lavis_ds evaluates with; BlipImageProcessor does the same steps.
EVAL_IMAGE_PROCESSOR = "blip2_image_eval"


def check_expressible(model: nn.Module, image_cfg: dict[str, Any]) -> None:
    """Raise one ExportError listing everything of ``model`` that Blip2ForConditionalGeneration cannot hold."""
    problems = [f"model.{name}: missing (not a blip2_qwen model)" for name in
                ("visual_encoder", "ln_vision", "qformer", "query_tokens", "llm_proj", "llm_model")
                if not hasattr(model, name)]
    if not problems:
        problems = (vit_problems(model.visual_encoder) + _norm_problems("ln_vision", model.ln_vision)
                    + llm_problems(model.llm_model) + _image_processor_problems(image_cfg))
        if model.llm_proj.bias is None:
            problems.append("llm_proj has no bias; language_projection has one")
        problems += _prompt_problems(model)
    if problems:
        raise ExportError("cannot export as transformers' Blip2ForConditionalGeneration, which cannot express:\n  - "
                          + "\n  - ".join(problems))


def vit_problems(vit: nn.Module) -> list[str]:
    """What of the vision tower Blip2VisionModel lacks (it is EVA-ViT-g as BLIP-2 uses it, and nothing else)."""
    from timm.models.eva import Eva

    if not isinstance(vit, Eva):
        return [f"visual_encoder is {type(vit).__name__}; Blip2VisionModel is EVA's layout (timm Eva)"]
    problems = []
    if getattr(vit, "rope", None) is not None:
        problems.append("visual_encoder: rotary position embedding (rope); Blip2VisionModel adds absolute ones only")
    if vit.pos_embed is None or vit.cls_token is None or vit.num_prefix_tokens != 1 or vit.no_embed_class:
        problems.append(f"visual_encoder: {vit.num_prefix_tokens} prefix token(s), absolute position embedding "
                        f"{'absent' if vit.pos_embed is None else 'present'}"
                        f"{', none for the class token' if vit.no_embed_class else ''}; Blip2VisionModel has one "
                        "class token and an absolute position embedding for every token")
    size, patch = vit.patch_embed.img_size, vit.patch_embed.patch_size
    if size[0] != size[1] or patch[0] != patch[1]:
        problems.append(f"visual_encoder: image {tuple(size)} / patch {tuple(patch)} are not square")
    if vit.patch_embed.proj.bias is None or not isinstance(vit.patch_embed.norm, nn.Identity):
        problems.append("visual_encoder.patch_embed: a norm or no bias; Blip2VisionModel's is a plain biased conv")
    for name in ("norm_pre", "norm", "fc_norm"):
        if not isinstance(getattr(vit, name, nn.Identity()), nn.Identity):
            problems.append(f"visual_encoder.{name}: {type(getattr(vit, name)).__name__}; Blip2VisionModel has only "
                            "post_layernorm, which is ln_vision")
    problems += [p for i, block in enumerate(vit.blocks) for p in block_problems(f"visual_encoder.blocks.{i}", block)]
    eps = {m.eps for m in vit.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) > 1:
        problems.append(f"visual_encoder: layer norms with different eps {sorted(eps)}; Blip2VisionConfig has one")
    widths = {block.mlp.fc1.out_features for block in vit.blocks if hasattr(block.mlp, "fc1")}
    if len(widths) > 1:
        problems.append(f"visual_encoder: MLP widths {sorted(widths)} differ between blocks")
    return problems


def block_problems(where: str, block: nn.Module) -> list[str]:
    """One EVA block against Blip2EncoderLayer: pre-norm attention and GELU MLP, residuals without scaling."""
    from timm.layers import Mlp
    from timm.models.eva import EvaBlock

    problems = []
    if type(block) is not EvaBlock:  # EvaBlockPostNorm has the same submodules, applied in another order
        problems.append(f"{where}: {type(block).__name__}; Blip2EncoderLayer is EvaBlock's pre-norm layout")
    if getattr(block, "gamma_1", None) is not None or getattr(block, "gamma_2", None) is not None:
        problems.append(f"{where}: layer scale (gamma_1/gamma_2, init_values); Blip2EncoderLayer adds residuals "
                        "unscaled")
    attn = block.attn
    if getattr(attn, "qkv", None) is None:
        problems.append(f"{where}.attn: separate q/k/v projections; Blip2Attention has one fused qkv")
    for name in ("q_norm", "k_norm", "norm"):
        if not isinstance(getattr(attn, name, nn.Identity()), nn.Identity):
            problems.append(f"{where}.attn.{name}: {type(getattr(attn, name)).__name__}; Blip2Attention has no norm")
    if getattr(attn, "gate", None) is not None:
        problems.append(f"{where}.attn.gate: gated attention; Blip2Attention has no gate")
    if getattr(attn, "qkv", None) is not None and attn.head_dim * attn.num_heads != attn.qkv.in_features:
        problems.append(f"{where}.attn: head_dim {attn.head_dim} x {attn.num_heads} heads != width "
                        f"{attn.qkv.in_features}; Blip2Attention's head_dim is width / heads")
    mlp = block.mlp
    if type(mlp) is not Mlp or not isinstance(mlp.norm, nn.Identity):
        problems.append(f"{where}.mlp: {type(mlp).__name__}{' with a norm' if type(mlp) is Mlp else ''}; "
                        "Blip2MLP is fc1 -> activation -> fc2")
    elif activation_name(mlp.act) is None:
        problems.append(f"{where}.mlp.act: {mlp.act!r}; Blip2MLP's activations here: "
                        + ", ".join(f"GELU(approximate={k!r})" for k in GELU_ACTIVATIONS))
    return problems + _norm_problems(f"{where}.norm1", block.norm1) + _norm_problems(f"{where}.norm2", block.norm2)


def activation_name(act: nn.Module) -> str | None:
    """The ACT2FN name of a torch GELU, else None."""
    return GELU_ACTIVATIONS.get(act.approximate) if type(act) is nn.GELU else None


def _norm_problems(where: str, norm: nn.Module) -> list[str]:
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None:
        return []
    return [f"{where}: {norm!r}; Blip2VisionModel's norms are LayerNorms with weight and bias"]


def llm_problems(llm: nn.Module) -> list[str]:
    """Blip2Config's text_config builds the LLM with AutoModelForCausalLM: it must build this very class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(getattr(llm, "config", None), "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return [f"llm_model: {type(llm).__name__} with config model_type {model_type!r}, which "
                "AutoModelForCausalLM (what Blip2Config's text_config is built with) does not know"]
    built = MODEL_FOR_CAUSAL_LM_MAPPING[type(llm.config)]
    if built is not type(llm):
        return [f"llm_model: {type(llm).__name__}, but text_config model_type {model_type!r} builds {built.__name__}"]
    return []


def _image_processor_problems(image_cfg: dict[str, Any]) -> list[str]:
    if image_cfg.get("name") == EVAL_IMAGE_PROCESSOR:
        return []
    return [f"the eval image processor {image_cfg.get('name')!r}; BlipImageProcessor reproduces "
            f"{EVAL_IMAGE_PROCESSOR} (square bicubic resize, normalise) only"]


def _prompt_problems(model: nn.Module) -> list[str]:
    """The export writes lavis_ds's ChatML prompt as the folder's chat template (export_hf_processor): a model
    whose prompt is another family's chat template (Llama 3, Gemma, ...) would be prompted otherwise there."""
    prompt = getattr(model, "prompt", None)
    if prompt is None:
        return []
    im_end = prompt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if prompt.end_of_turn_id == im_end:
        return []
    name = prompt.tokenizer.convert_ids_to_tokens(prompt.end_of_turn_id)
    return [f"the prompt: the LLM's chat template ends its turns with {name!r}, not ChatML's <|im_end|>, and the HF "
            "export's chat template writes ChatML only; export with --format lavis_ds"]
