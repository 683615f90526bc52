"""What of an EVA vision tower transformers' ``Blip2VisionModel`` (BLIP-2's and InstructBLIP's ``vision_model``)
cannot express, read from the built modules so that a variant added later is judged by what it computes.

``Blip2VisionModel`` is EVA-ViT-g as BLIP-2 uses it: class token, absolute position embedding, pre-norm blocks with a
fused qkv whose k bias is zero, a GELU MLP, no layer scale, no rope, LayerNorms of one eps, then ``post_layernorm``
(BLIP-2's ``ln_vision``). Every problem is one line; the BLIP families (``lavis_ds.models.hf.blip``) collect them.
"""
from __future__ import annotations

from torch import nn

# torch GELU flavours -> the names transformers' ACT2FN knows them by.
GELU_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}


def activation_name(act: nn.Module) -> str | None:
    """The ACT2FN name of a torch GELU, else None."""
    return GELU_ACTIVATIONS.get(act.approximate) if type(act) is nn.GELU else None


def vit_problems(vit: nn.Module, where: str = "vision_tower.vit") -> list[str]:
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
    return problems + norm_problems(f"{where}.norm1", block.norm1) + norm_problems(f"{where}.norm2", block.norm2)


def norm_problems(where: str, norm: nn.Module) -> list[str]:
    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None:
        return []
    return [f"{where}: {norm!r}; Blip2VisionModel's norms are LayerNorms with weight and bias"]

