"""The key names and shapes of LAVIS's BLIP-2 checkpoints (EVA-ViT-g, Q-Former, the stage-1 and BLIP-2-T5 files),
transcribed from LAVIS's module structure at the sizes of lavis_ds's `tiny` presets, and the LAVIS -> Hugging Face
name rules transformers publishes: the tests write tiny LAVIS `.pth` files from a transformers model with them
(tests/test_pretrained.py)."""
from __future__ import annotations

import re

import torch

from lavis_ds.models import Blip2Qwen, EvaViT

VIT = EvaViT.default_config("tiny")  # 64 wide, 2 blocks, 4 heads, patch 16, 64 px
BLIP = Blip2Qwen.default_config("tiny")  # Q-Former 64 wide, 2 layers; 8 queries
WIDTH, DEPTH, PATCH, SIZE = VIT["embed_dim"], VIT["depth"], VIT["patch_size"], VIT["img_size"]
MLP = int(WIDTH * VIT["mlp_ratio"])
QFORMER, N_QUERY = BLIP["qformer"], BLIP["num_query_token"]
BERT_VOCAB, BERT_POSITIONS = 30, 16  # LAVIS's are bert-base-uncased's 30523 and 512; only their shapes matter here


def lavis_eva_vit_keys(depth: int, grid: int = SIZE // PATCH) -> dict[str, tuple]:
    """Parameters of LAVIS ``eva_vit.py``'s ``VisionTransformer`` as ``create_eva_vit_g`` builds it.

    qkv_bias=True gives ``attn.q_bias``/``attn.v_bias`` beside a bias-free ``attn.qkv``; absolute
    ``pos_embed``; no relative position bias, no layer scale (gamma), no final norm or head.
    """
    keys = {"cls_token": (1, 1, WIDTH), "pos_embed": (1, grid * grid + 1, WIDTH),
            "patch_embed.proj.weight": (WIDTH, 3, PATCH, PATCH), "patch_embed.proj.bias": (WIDTH,)}
    for i in range(depth):
        keys.update({f"blocks.{i}.{name}": shape for name, shape in {
            "norm1.weight": (WIDTH,), "norm1.bias": (WIDTH,),
            "attn.q_bias": (WIDTH,), "attn.v_bias": (WIDTH,), "attn.qkv.weight": (3 * WIDTH, WIDTH),
            "attn.proj.weight": (WIDTH, WIDTH), "attn.proj.bias": (WIDTH,),
            "norm2.weight": (WIDTH,), "norm2.bias": (WIDTH,),
            "mlp.fc1.weight": (MLP, WIDTH), "mlp.fc1.bias": (MLP,),
            "mlp.fc2.weight": (WIDTH, MLP), "mlp.fc2.bias": (WIDTH,)}.items()})
    return keys


def _linear(prefix: str, n_out: int, n_in: int) -> dict[str, tuple]:
    return {f"{prefix}.weight": (n_out, n_in), f"{prefix}.bias": (n_out,)}


def _layer_norm(prefix: str, n: int) -> dict[str, tuple]:
    return {f"{prefix}.weight": (n,), f"{prefix}.bias": (n,)}


def lavis_qformer_keys(text_parts: bool) -> dict[str, tuple]:
    """LAVIS ``Qformer.py``: ``Qformer = BertLMHeadModel`` (``.bert`` + ``.cls``), built by ``Blip2Base.init_Qformer``.

    Each ``BertLayer`` has ``attention`` (``self.query/key/value`` + ``output.dense/LayerNorm``),
    ``crossattention`` on layers with ``layer_num % cross_attention_freq == 0`` (key/value from
    the ViT width), a text FFN ``intermediate``/``output`` and a query FFN ``intermediate_query``/
    ``output_query``. ``Blip2T5``/``Blip2OPT`` set ``cls``, the word/position embeddings and the
    text FFN to None (``text_parts=False``); the stage-1 ``Blip2Qformer`` keeps them.
    """
    hidden, ffn = QFORMER["hidden_size"], QFORMER["intermediate_size"]
    keys: dict[str, tuple] = {**_layer_norm("Qformer.bert.embeddings.LayerNorm", hidden),
                              "Qformer.bert.embeddings.position_ids": (1, BERT_POSITIONS)}
    if text_parts:
        keys.update({"Qformer.bert.embeddings.word_embeddings.weight": (BERT_VOCAB, hidden),
                     "Qformer.bert.embeddings.position_embeddings.weight": (BERT_POSITIONS, hidden)})
    for i in range(QFORMER["num_hidden_layers"]):
        layer = f"Qformer.bert.encoder.layer.{i}"
        attentions = ["attention"] + (["crossattention"] if i % QFORMER["cross_attention_frequency"] == 0 else [])
        for att in attentions:
            kv_width = WIDTH if att == "crossattention" else hidden
            keys.update({**_linear(f"{layer}.{att}.self.query", hidden, hidden),
                         **_linear(f"{layer}.{att}.self.key", hidden, kv_width),
                         **_linear(f"{layer}.{att}.self.value", hidden, kv_width),
                         **_linear(f"{layer}.{att}.output.dense", hidden, hidden),
                         **_layer_norm(f"{layer}.{att}.output.LayerNorm", hidden)})
        for suffix in ["_query"] + ([""] if text_parts else []):
            keys.update({**_linear(f"{layer}.intermediate{suffix}.dense", ffn, hidden),
                         **_linear(f"{layer}.output{suffix}.dense", hidden, ffn),
                         **_layer_norm(f"{layer}.output{suffix}.LayerNorm", hidden)})
    if text_parts:
        keys.update({**_linear("Qformer.cls.predictions.transform.dense", hidden, hidden),
                     **_layer_norm("Qformer.cls.predictions.transform.LayerNorm", hidden),
                     "Qformer.cls.predictions.bias": (BERT_VOCAB,), "Qformer.cls.predictions.decoder.weight":
                         (BERT_VOCAB, hidden), "Qformer.cls.predictions.decoder.bias": (BERT_VOCAB,)})
    return keys


def lavis_blip2_stage1_keys() -> dict[str, tuple]:
    """``Blip2Qformer.state_dict()`` (LAVIS ``blip2_qformer.py``): ViT, ln_vision, full Q-Former, stage-1 heads."""
    hidden = QFORMER["hidden_size"]
    return {**{f"visual_encoder.{k}": s for k, s in lavis_eva_vit_keys(DEPTH).items()},
            **_layer_norm("ln_vision", WIDTH), **lavis_qformer_keys(text_parts=True),
            "query_tokens": (1, N_QUERY, hidden), **_linear("vision_proj", 256, hidden),
            **_linear("text_proj", 256, hidden), **_linear("itm_head", 2, hidden), "temp": ()}


def lavis_blip2_t5_trained_keys() -> dict[str, tuple]:
    """What LAVIS's runner saves of ``Blip2T5`` (``blip2_t5.py``): trained parameters and buffers only.

    The frozen ViT and T5 are dropped (``_save_checkpoint`` deletes parameters with
    requires_grad=False), so the ViT must come from eva_vit_g.pth.
    """
    return {**_layer_norm("ln_vision", WIDTH), **lavis_qformer_keys(text_parts=False),
            "query_tokens": (1, N_QUERY, QFORMER["hidden_size"]), **_linear("t5_proj", 96, QFORMER["hidden_size"])}


def hf_name(lavis_key: str) -> str:
    """transformers' ``convert_blip_2_original_to_pytorch.py``: ``create_rename_keys`` then its replace loop."""
    fixed = {"visual_encoder.cls_token": "vision_model.embeddings.class_embedding",
             "visual_encoder.pos_embed": "vision_model.embeddings.position_embedding",
             "visual_encoder.patch_embed.proj.weight": "vision_model.embeddings.patch_embedding.weight",
             "visual_encoder.patch_embed.proj.bias": "vision_model.embeddings.patch_embedding.bias",
             "ln_vision.weight": "vision_model.post_layernorm.weight",
             "ln_vision.bias": "vision_model.post_layernorm.bias",
             "Qformer.bert.embeddings.LayerNorm.weight": "qformer.layernorm.weight",
             "Qformer.bert.embeddings.LayerNorm.bias": "qformer.layernorm.bias"}
    block = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
             "attn.q_bias": "self_attn.q_bias", "attn.v_bias": "self_attn.v_bias", "attn.proj": "self_attn.projection",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    key = fixed.get(lavis_key, lavis_key)
    if m := re.match(r"visual_encoder\.blocks\.(\d+)\.(" + "|".join(map(re.escape, block)) + r")(.*)", key):
        key = f"vision_model.encoder.layers.{m[1]}.{block[m[2]]}{m[3]}"
    if key.startswith("Qformer.bert"):
        key = key.replace("Qformer.bert", "qformer")
    if "attention.self" in key:
        key = key.replace("self", "attention")
    return key


def lavis_state(keys: dict[str, tuple], hf_state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors for LAVIS ``keys``: the HF model's tensor where the conversion rules name one, random otherwise.

    Current transformers fuses EVA's biases into ``self_attn.qkv.bias`` = [q_bias, k part, v_bias].
    """
    gen = torch.Generator().manual_seed(1)
    out = {}
    for key, shape in keys.items():
        name = hf_name(prefix + key)
        fused = name[:-len("q_bias")] + "qkv.bias"
        if name.endswith(("self_attn.q_bias", "self_attn.v_bias")) and fused in hf_state:
            q, _, v = hf_state[fused].chunk(3)
            out[key] = (q if name.endswith("q_bias") else v).clone()
        elif name in hf_state:
            out[key] = hf_state[name].clone()
        elif key.endswith("position_ids"):  # a BERT buffer
            out[key] = torch.arange(shape[-1]).expand(shape).clone()
        else:
            out[key] = torch.randn(shape, generator=gen) if shape else torch.tensor(0.07)
        assert tuple(out[key].shape) == shape, (key, out[key].shape, shape)
    return out
