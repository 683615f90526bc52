"""Which transformers class a lavis_ds model exports to, and what of the model that class cannot express.

Three classes, each one fixed architecture:

- ``Blip2ForConditionalGeneration``: ``blip2_qwen``, or an ``eva_vit_g`` tower with the ``qformer`` connector;
- ``InstructBlipForConditionalGeneration``: an ``eva_vit_g`` tower with the ``instruct_qformer`` connector;
- ``LlavaForConditionalGeneration``: a ``clip`` or ``siglip`` tower with the ``mlp2x_gelu`` connector.

Any other tower + connector pair has no transformers class and is refused at once (:func:`hf_target`). For the
three, the checks read the built modules, not the config, so that a variant added later is judged by what it
computes: EVA-ViT-g's layout (class token, absolute position embedding, pre-norm blocks with a fused qkv whose k
bias is zero, a GELU MLP, no layer scale, no rope, LayerNorms of one eps, then ``post_layernorm``), transformers'
own tower, Q-Former and projector classes, and any causal LM that transformers builds from ``text_config`` as
the same class. Every problem is collected and reported at once.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from lavis_ds.apps.export_hf_blip import GELU_ACTIVATIONS, BlipParts, activation_name  # noqa: F401
from lavis_ds.apps.export_io import ExportError

# The image processor lavis_ds evaluates blip2_qwen with; BlipImageProcessor does the same steps.
EVAL_IMAGE_PROCESSOR = "blip2_image_eval"
# Target -> the transformers class it writes.
HF_CLASSES = {"blip2": "Blip2ForConditionalGeneration", "instructblip": "InstructBlipForConditionalGeneration",
              "llava": "LlavaForConditionalGeneration"}
# (tower, connector) registry names -> target: the pairs a transformers class holds.
PAIRS = {("eva_vit_g", "qformer"): "blip2", ("eva_vit_g", "instruct_qformer"): "instructblip",
         ("clip", "mlp2x_gelu"): "llava", ("siglip", "mlp2x_gelu"): "llava"}
EXPORTABLE = ("LlavaForConditionalGeneration: a clip or siglip tower + mlp2x_gelu; "
              "InstructBlipForConditionalGeneration: "
              "eva_vit_g + instruct_qformer; Blip2ForConditionalGeneration: blip2_qwen, or eva_vit_g + qformer")
INSTEAD = ("export it with --format lavis_ds (the default): a folder of its trained weights and config that "
           "lavis_ds loads (load_exported, `python -m lavis_ds.apps.generate`, chat, the web page)")
# Why a pair that looks close has no class (the others: no class holds that tower with that connector).
WHY_NOT = {"linear": "LlavaConfig's projector is always linear_1 -> projector_hidden_act -> linear_2, two layers: "
                     "a single linear connector has no place in it"}


def part_name(part: nn.Module, kind: str) -> str:
    """The registry name of a tower or connector (exact class: a subclass may compute otherwise), else its class."""
    from lavis_ds.common.registry import connectors, vision_towers

    registry = vision_towers if kind == "tower" else connectors
    return next((name for name in registry if registry.get(name) is type(part)), type(part).__name__)


def hf_target(model: nn.Module) -> str:
    """``blip2``, ``instructblip`` or ``llava``: the transformers class ``model`` exports to; ExportError if none."""
    if not hasattr(model, "vision_tower"):
        missing = [f"model.{name}" for name in ("visual_encoder", "ln_vision", "qformer", "query_tokens", "llm_proj",
                                                 "llm_model") if not hasattr(model, name)]
        if missing:
            raise ExportError(f"--format hf: {type(model).__name__} is neither blip2_qwen ({', '.join(missing)} "
                              f"missing (not a blip2_qwen model)) nor a vision_tower + connector architecture; "
                              f"{INSTEAD}")
        return "blip2"
    tower, connector = part_name(model.vision_tower, "tower"), part_name(model.connector, "connector")
    target = PAIRS.get((tower, connector))
    if target is None:
        why = WHY_NOT.get(connector, "no transformers class holds this tower with this connector")
        raise ExportError(f"--format hf: cannot export vision tower {tower!r} + connector {connector!r}: {why}. "
                          f"What --format hf writes: {EXPORTABLE}. For this model, {INSTEAD}")
    return target


def check_expressible(model: nn.Module, image_cfg: dict[str, Any] | None = None) -> str:
    """The target of ``model`` (:func:`hf_target`); one ExportError listing everything its class cannot hold."""
    target = hf_target(model)
    if target == "llava":
        problems = llava_problems(model, image_cfg)
    else:
        problems = blip_problems(model, target, image_cfg)
    problems += _prompt_problems(model)
    if problems:
        raise ExportError(f"cannot export as transformers' {HF_CLASSES[target]}, which cannot express:\n  - "
                          + "\n  - ".join(problems))
    return target


def blip_problems(model: nn.Module, target: str, image_cfg: dict[str, Any] | None) -> list[str]:
    """BLIP-2 / InstructBLIP: the EVA layout, LayerNorms, the LLM class, the projection's bias, the pixels."""
    parts = BlipParts.of(model)
    problems = (vit_problems(parts.vit, parts.vit_name) + _norm_problems(parts.ln_name, parts.ln_vision)
                + llm_problems(parts.llm))
    if parts.llm_proj.bias is None:
        problems.append(f"{parts.proj_name} has no bias; language_projection has one")
    return problems + _image_processor_problems(image_cfg, square_only=True)


def vit_problems(vit: nn.Module, where: str = "visual_encoder") -> list[str]:
    """What of the vision tower Blip2VisionModel lacks (it is EVA-ViT-g as BLIP-2 uses it, and nothing else)."""
    from timm.models.eva import Eva

    if not isinstance(vit, Eva):
        return [f"{where} is {type(vit).__name__}; Blip2VisionModel is EVA's layout (timm Eva)"]
    problems = []
    if getattr(vit, "rope", None) is not None:
        problems.append(f"{where}: rotary position embedding (rope); Blip2VisionModel adds absolute ones only")
    if vit.pos_embed is None or vit.cls_token is None or vit.num_prefix_tokens != 1 or vit.no_embed_class:
        problems.append(f"{where}: {vit.num_prefix_tokens} prefix token(s), absolute position embedding "
                        f"{'absent' if vit.pos_embed is None else 'present'}"
                        f"{', none for the class token' if vit.no_embed_class else ''}; Blip2VisionModel has one "
                        "class token and an absolute position embedding for every token")
    size, patch = vit.patch_embed.img_size, vit.patch_embed.patch_size
    if size[0] != size[1] or patch[0] != patch[1]:
        problems.append(f"{where}: image {tuple(size)} / patch {tuple(patch)} are not square")
    if vit.patch_embed.proj.bias is None or not isinstance(vit.patch_embed.norm, nn.Identity):
        problems.append(f"{where}.patch_embed: a norm or no bias; Blip2VisionModel's is a plain biased conv")
    for name in ("norm_pre", "norm", "fc_norm"):
        if not isinstance(getattr(vit, name, nn.Identity()), nn.Identity):
            problems.append(f"{where}.{name}: {type(getattr(vit, name)).__name__}; Blip2VisionModel has only "
                            "post_layernorm, which is ln_vision")
    problems += [p for i, block in enumerate(vit.blocks) for p in block_problems(f"{where}.blocks.{i}", block)]
    eps = {m.eps for m in vit.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) > 1:
        problems.append(f"{where}: layer norms with different eps {sorted(eps)}; Blip2VisionConfig has one")
    widths = {block.mlp.fc1.out_features for block in vit.blocks if hasattr(block.mlp, "fc1")}
    if len(widths) > 1:
        problems.append(f"{where}: MLP widths {sorted(widths)} differ between blocks")
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


def llava_problems(model: nn.Module, image_cfg: dict[str, Any] | None) -> list[str]:
    """LLaVA: transformers builds the tower and the LLM's base model with AutoModel from their configs, and
    computes the logits as ``lm_head(hidden states)``; the projector's activation is an ACT2FN name."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from lavis_ds.apps.export_hf_llava import projector_act_name
    from lavis_ds.models.llm import base_llm

    problems = []
    tower_model = model.vision_tower.model
    if MODEL_MAPPING.get(type(tower_model.config), None) is not type(tower_model):
        problems.append(f"vision_tower.model: {type(tower_model).__name__}, which AutoModel does not build from its "
                        f"config ({type(tower_model.config).__name__})")
    connector = model.connector
    if projector_act_name(connector) is None:
        problems.append(f"connector.act: {connector.act!r} is no transformers ACT2FN activation (projector_hidden_act)")
    if (connector.linear_1.bias is None) != (connector.linear_2.bias is None):
        problems.append("connector: one linear layer with a bias and one without; multimodal_projector_bias is one "
                        "setting for both")
    llm = base_llm(model.llm_model)
    decoder = getattr(llm, getattr(llm, "base_model_prefix", ""), None)
    if decoder is None or MODEL_MAPPING.get(type(llm.config), None) is not type(decoder):
        problems.append(f"llm_model: {type(llm).__name__}, whose base model AutoModel (what LlavaConfig's text_config "
                        "is built with) does not build as the same class")
    head = llm.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        problems.append(f"llm_model's output layer: {head!r}; LLaVA's lm_head is a Linear without bias")
    softcap, scale = getattr(llm.config, "final_logit_softcapping", None), getattr(llm.config, "logit_scale", None)
    if softcap or (scale is not None and scale != 1):
        problems.append(f"llm_model: its logits are {'soft-capped' if softcap else f'scaled by {scale}'} after "
                        "lm_head; LlavaForConditionalGeneration computes lm_head(hidden states) only")
    return problems + llm_problems(model.llm_model) + _image_processor_problems(image_cfg, square_only=False)


def _image_processor_problems(image_cfg: dict[str, Any] | None, square_only: bool) -> list[str]:
    """The eval image processor lavis_ds generates with must be one the export's image processor reproduces."""
    from lavis_ds.apps.export_hf_processor import image_processing_of

    if image_cfg is None:  # the model's own processing (export_hf_processor.default_image_cfg), checked when written
        return []
    processing = image_processing_of(image_cfg)
    if processing is None:
        return [f"the eval image processor {image_cfg.get('name')!r}; the export's image processors reproduce "
                f"{EVAL_IMAGE_PROCESSOR} (square bicubic resize, normalise), tower_image_eval (the tower's "
                "processing) and other processors that carry an ImageProcessing only"]
    if square_only and (processing.resize != "squash" or processing.pad_to_square):
        return [f"the eval image processing {processing}; BlipImageProcessor reproduces a square resize without "
                "padding only"]
    return []


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
