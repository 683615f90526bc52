"""Published weights: Hugging Face BLIP-2 folders, LAVIS eva_vit_g.pth and LAVIS BLIP-2 .pth files.

Tiny checkpoints are written in the real formats: the HF folder by transformers'
own ``save_pretrained``; the LAVIS files with the key names and shapes of LAVIS's
module structure (transcribed below from LAVIS's source), their values taken from
the HF model through transformers' published LAVIS -> HF conversion rules. Our
outputs are compared with transformers' own forward pass.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Blip2Config, Blip2ForConditionalGeneration

from lavis_ds.config import ConfigError, load_config
from lavis_ds.models import Blip2Qwen, EvaViT
from lavis_ds.models.pretrained import CheckpointError, load_eva_vit, read_checkpoint
from run_utils import write_yaml

from lavis_layouts import (DEPTH, MLP, N_QUERY, PATCH, QFORMER, SIZE, VIT, WIDTH, hf_name, lavis_blip2_stage1_keys,
                           lavis_blip2_t5_trained_keys, lavis_eva_vit_keys, lavis_state)


# ----------------------------------------------------------------- fixtures
def tiny_hf_config(image_size: int = SIZE) -> Blip2Config:
    """A Blip2Config with the sizes of our `tiny` presets, and a tiny OPT as the (unused) LLM."""
    return Blip2Config(
        vision_config=dict(hidden_size=WIDTH, intermediate_size=MLP, num_hidden_layers=DEPTH,
                           num_attention_heads=VIT["num_heads"], image_size=image_size, patch_size=PATCH, qkv_bias=True),
        qformer_config=dict(QFORMER),
        text_config=dict(model_type="opt", hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=100, word_embed_proj_dim=32, max_position_embeddings=64),
        num_query_tokens=N_QUERY)


@pytest.fixture(scope="module")
def hf_blip2(tmp_path_factory):
    """A tiny HF BLIP-2 with random values everywhere, saved sharded by ``save_pretrained``."""
    torch.manual_seed(0)
    model = Blip2ForConditionalGeneration(tiny_hf_config()).eval()
    with torch.no_grad():
        # HF initialises the vision weights to ~1e-10, the queries to zero and the k part of qkv.bias to
        # zero: random values everywhere make a misplaced tensor (or a k bias that mattered) show.
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.1)
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.add_(1.0)
    folder = tmp_path_factory.mktemp("hf_blip2")
    model.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()  # sharded, like the real Salesforce/blip2-* folders
    return model, folder


@pytest.fixture
def images():
    return torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))


def build(cfg: dict, **overrides) -> Blip2Qwen:
    torch.manual_seed(0)
    return Blip2Qwen.from_config({**cfg, **overrides}).eval()


def ours(model: Blip2Qwen, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ln_vision(visual_encoder(x))`` and the Q-Former's query outputs, as ``encode_images`` computes them."""
    with torch.no_grad():
        features = model.connector.ln_vision(model.vision_tower.vit(images))
        mask = torch.ones(features.shape[:-1], dtype=torch.long)
        queries = model.connector.qformer(query_embeds=model.connector.query_tokens.expand(len(images), -1, -1),
                                encoder_hidden_states=features, encoder_attention_mask=mask).last_hidden_state
    return features, queries


def theirs(hf: Blip2ForConditionalGeneration, images: torch.Tensor, **vision_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        features = hf.vision_model(pixel_values=images, **vision_kwargs).last_hidden_state
        mask = torch.ones(features.shape[:-1], dtype=torch.long)
        queries = hf.qformer(query_embeds=hf.query_tokens.expand(len(images), -1, -1),
                             encoder_hidden_states=features, encoder_attention_mask=mask).last_hidden_state
    return features, queries


def assert_same_outputs(model, hf, images, atol=1e-5, **vision_kwargs):
    (our_features, our_queries), (hf_features, hf_queries) = ours(model, images), theirs(hf, images, **vision_kwargs)
    torch.testing.assert_close(our_features.float(), hf_features, atol=atol, rtol=atol)
    torch.testing.assert_close(our_queries.float(), hf_queries, atol=atol, rtol=atol)


def pretrained_part(model: Blip2Qwen) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()
            if k.startswith(("vision_tower.vit.", "connector.ln_vision.", "connector.qformer.", "connector.query_tokens"))}


# ----------------------------------------------------------------- Hugging Face folders
def test_hf_blip2_folder_gives_transformers_outputs(hf_blip2, tiny_model_config, images):
    hf, folder = hf_blip2
    random_init = build(tiny_model_config)
    model = build(tiny_model_config, load_pretrained=True, pretrained=str(folder))
    assert_same_outputs(model, hf, images)
    # Not a coincidence of random weights: without loading, the outputs differ.
    assert not torch.allclose(ours(random_init, images)[1], theirs(hf, images)[1], atol=1e-2)


def test_hf_blip2_single_safetensors_file(hf_blip2, tiny_model_config, images, tmp_path):
    hf, _ = hf_blip2
    hf.save_pretrained(tmp_path)  # unsharded: one model.safetensors
    assert (tmp_path / "model.safetensors").is_file()
    assert_same_outputs(build(tiny_model_config, load_pretrained=True, pretrained=str(tmp_path)), hf, images)
    fmt, state, skipped = read_checkpoint(tmp_path / "model.safetensors")  # the file itself works too
    assert fmt == "hf_blip2" and "query_tokens" in state
    assert skipped and all(k.startswith(("language_model.", "language_projection.")) for k in skipped)


def test_position_embedding_is_interpolated_like_transformers(hf_blip2, tiny_model_config):
    hf, folder = hf_blip2
    big = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(4))  # 6x6 patches, the file has 4x4
    model = build(tiny_model_config, image_size=96, load_pretrained=True, pretrained=str(folder))
    assert model.vision_tower.vit.pos_embed.shape == (1, 1 + 36, WIDTH)
    # transformers' interpolate_pos_encoding is the same bicubic resize of the patch grid, CLS kept.
    assert_same_outputs(model, hf, big, interpolate_pos_encoding=True)


# ----------------------------------------------------------------- LAVIS files
def test_our_eva_vit_has_lavis_names_key_for_key():
    vit = EvaViT.from_config(VIT)
    assert {k: tuple(v.shape) for k, v in vit.state_dict().items()} == lavis_eva_vit_keys(DEPTH)


def test_lavis_stage1_blip2_checkpoint_loads_where_the_hf_weights_load(hf_blip2, tiny_model_config, images, tmp_path):
    hf, folder = hf_blip2
    hf_state = hf.state_dict()
    keys = lavis_blip2_stage1_keys()
    path = tmp_path / "blip2_pretrained.pth"
    torch.save({"model": lavis_state(keys, hf_state)}, path)

    # The LAVIS layout covers every tensor of HF's vision model, Q-Former and queries, as the conversion
    # script asserts (HF's fused qkv.bias comes from LAVIS's q_bias and v_bias).
    uncovered = {k for k in hf_state if not k.startswith("language_")} - {hf_name(k) for k in keys}
    assert uncovered == {k for k in hf_state if k.endswith("self_attn.qkv.bias")}
    # Skipped: exactly the LAVIS keys that have no HF counterpart (text parts, LM head, stage-1 heads).
    _, _, skipped = read_checkpoint(path)
    assert set(skipped) == {k for k in keys if hf_name(k) not in hf_state and "_bias" not in k}
    assert {"Qformer.cls.predictions.bias", "Qformer.bert.embeddings.position_ids", "temp",
            "Qformer.bert.encoder.layer.0.output.LayerNorm.weight"} <= set(skipped)

    lavis = build(tiny_model_config, load_pretrained=True, pretrained=str(path))
    assert_same_outputs(lavis, hf, images)
    from_hf = build(tiny_model_config, load_pretrained=True, pretrained=str(folder))
    for key, value in pretrained_part(from_hf).items():
        assert torch.equal(pretrained_part(lavis)[key], value), key


def test_lavis_eva_vit_g_with_a_40th_block_and_blip2_t5_checkpoint(hf_blip2, tiny_model_config, images, tmp_path):
    hf, _ = hf_blip2
    hf_state = hf.state_dict()
    # eva_vit_g.pth holds one block more than BLIP-2 builds (40 vs 39): here DEPTH + 1.
    vit_keys = lavis_eva_vit_keys(DEPTH + 1)
    vit_path, blip2_path = tmp_path / "eva_vit_g.pth", tmp_path / "blip2_pretrained_flant5xxl.pth"
    torch.save(lavis_state(vit_keys, hf_state, prefix="visual_encoder."), vit_path)
    blip2_keys = lavis_blip2_t5_trained_keys()
    torch.save({"model": lavis_state(blip2_keys, hf_state)}, blip2_path)

    model = build(tiny_model_config, vit_pretrained=str(vit_path), load_pretrained=True, pretrained=str(blip2_path))
    assert_same_outputs(model, hf, images)
    _, _, skipped = read_checkpoint(blip2_path)
    assert set(skipped) == {"Qformer.bert.embeddings.position_ids", "t5_proj.weight", "t5_proj.bias"}

    vit = EvaViT.from_config(VIT)
    load_eva_vit(vit, vit_path)  # the last block is skipped, every other key is used
    own = vit.state_dict()
    assert not any(k.startswith(f"blocks.{DEPTH}.") for k in own)
    file = torch.load(vit_path)
    for key, value in own.items():
        assert torch.equal(value, file[key]), key


def test_eva_vit_position_embedding_interpolation_keeps_cls(hf_blip2, tmp_path):
    path = eva_vit_file(hf_blip2[0], tmp_path)
    file = torch.load(path)["pos_embed"]
    vit = EvaViT.from_config({**VIT, "img_size": 128, "load_pretrained": True, "pretrained": str(path)})
    pos = vit.pos_embed.detach()
    assert pos.shape == (1, 1 + 8 * 8, WIDTH)
    assert torch.equal(pos[:, :1], file[:, :1])  # CLS kept
    # LAVIS's interpolate_pos_embed: bicubic resize of the (4, 4) grid, align_corners=False.
    grid = file[:, 1:].reshape(1, 4, 4, WIDTH).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(8, 8), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).flatten(1, 2)
    torch.testing.assert_close(pos[:, 1:], expected)


# ----------------------------------------------------------------- precision, gradient checkpointing
@pytest.mark.parametrize("precision, dtype, atol", [("fp16", torch.float16, 2e-2), ("bf16", torch.bfloat16, 1e-1)])
def test_vit_precision_applies_after_loading(precision, dtype, atol, hf_blip2, tiny_model_config, images):
    hf, folder = hf_blip2
    model = build(tiny_model_config, vit_precision=precision, load_pretrained=True, pretrained=str(folder))
    assert {p.dtype for p in model.vision_tower.vit.parameters()} == {dtype}
    hf_state = hf.state_dict()
    assert torch.equal(model.vision_tower.vit.patch_embed.proj.weight,
                       hf_state["vision_model.embeddings.patch_embedding.weight"].to(dtype))
    # ln_vision and the Q-Former stay fp32 (ln_vision also computes in fp32).
    assert model.connector.ln_vision.weight.dtype == model.connector.query_tokens.dtype == torch.float32
    assert torch.equal(model.connector.ln_vision.weight, hf_state["vision_model.post_layernorm.weight"])
    features, _ = ours(model, images)
    assert features.dtype == dtype
    torch.testing.assert_close(features.float(), theirs(hf, images)[0], atol=atol, rtol=atol)


def test_grad_checkpointing_gives_the_same_output_and_gradients(hf_blip2, tmp_path):
    path = eva_vit_file(hf_blip2[0], tmp_path)
    image = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5))
    results = {}
    for checkpointed in (False, True):
        vit = EvaViT.from_config({**VIT, "use_grad_checkpoint": checkpointed, "load_pretrained": True,
                                  "pretrained": str(path)}).train()
        calls = []
        # On the attention, not the block: torch stops recomputing a block once it has every saved tensor back.
        vit.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
        x = image.clone().requires_grad_(True)
        out = vit(x)
        out.pow(2).mean().backward()
        results[checkpointed] = out.detach(), x.grad, {n: p.grad for n, p in vit.named_parameters()}
        assert len(calls) == (2 if checkpointed else 1)  # checkpointing recomputes the block in backward
    (out, x_grad, grads), (ck_out, ck_x_grad, ck_grads) = results[False], results[True]
    torch.testing.assert_close(ck_out, out)
    torch.testing.assert_close(ck_x_grad, x_grad)
    for name, grad in grads.items():
        torch.testing.assert_close(ck_grads[name], grad, msg=name)


# ----------------------------------------------------------------- bad inputs
def test_missing_files_are_named(tiny_model_config, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.pth: checkpoint not found"):
        build(tiny_model_config, load_pretrained=True, pretrained=str(tmp_path / "nope.pth"))
    with pytest.raises(FileNotFoundError, match=r"eva_vit_g\.pth: checkpoint not found"):
        build(tiny_model_config, vit_pretrained=str(tmp_path / "eva_vit_g.pth"))


def test_missing_files_are_reported_at_config_time_with_their_key(tiny_tokenizer_dir, tmp_path):
    from PIL import Image

    (tmp_path / "images").mkdir()
    Image.new("RGB", (32, 32), "red").save(tmp_path / "images" / "a.png")
    ann = tmp_path / "train.json"
    ann.write_text(json.dumps([{"image": "a.png", "instruction": "<Img><ImageHere></Img> What?", "output": "red"}]))
    cfg = write_yaml(tmp_path / "run.yaml", {
        "model": {"arch": "blip2_qwen", "model_type": "tiny", "tokenizer": str(tiny_tokenizer_dir),
                  "load_pretrained": True, "pretrained": str(tmp_path / "blip2.pth"),
                  "vit_pretrained": str(tmp_path / "eva_vit_g.pth")},
        "datasets": {"minigpt4qwen_instruction": {"build_info": {
            "annotations": {"train": {"storage": str(ann)}}, "images": {"storage": str(tmp_path / "images")}},
            "vis_processor": {"train": {"image_size": 64}, "eval": {"image_size": 64}}}},
        "run": {"output_dir": str(tmp_path / "out"),
                "batch_size_train": 1, "zero_stage": 2},
    })
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert sorted(info.value.problems) == [f"model.pretrained: '{tmp_path / 'blip2.pth'}' does not exist",
                                           f"model.vit_pretrained: '{tmp_path / 'eva_vit_g.pth'}' does not exist"]


def test_wrong_formats_are_refused_with_the_valid_ones(hf_blip2, tiny_model_config, tmp_path):
    hf, folder = hf_blip2
    unknown = tmp_path / "unknown.pth"
    torch.save({"state_dict": {"fc.weight": torch.zeros(2, 2)}}, unknown)
    with pytest.raises(CheckpointError, match=r"unknown\.pth: not a checkpoint format we know .*'state_dict'.*"
                                              r"Expected one of: LAVIS eva_vit_g\.pth"):
        build(tiny_model_config, load_pretrained=True, pretrained=str(unknown))
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"notes\.pth: cannot be read by torch\.load"):
        build(tiny_model_config, load_pretrained=True, pretrained=str(text))
    with pytest.raises(CheckpointError,
                       match=r"folder has neither model\.safetensors nor model\.safetensors\.index\.json"):
        build(tiny_model_config, load_pretrained=True, pretrained=str(tmp_path))
    vit_file = eva_vit_file(hf, tmp_path)
    with pytest.raises(CheckpointError, match=r"eva_vit_g\.pth: is a LAVIS eva_vit_g\.pth.*give it as `vit_pretrained`"):
        build(tiny_model_config, load_pretrained=True, pretrained=vit_file)
    # `vit_pretrained` is the eva_vit_g tower's `pretrained`, which also reads a BLIP-2 folder's vision_model.
    model = build(tiny_model_config, vit_pretrained=str(folder))
    assert torch.equal(model.vision_tower.vit.patch_embed.proj.weight,
                       hf.vision_model.embeddings.patch_embedding.weight)


def eva_vit_file(hf, tmp_path) -> str:
    path = tmp_path / "eva_vit_g.pth"
    torch.save(lavis_state(lavis_eva_vit_keys(DEPTH), hf.state_dict(), prefix="visual_encoder."), path)
    return str(path)


def lavis_t5_file(hf, tmp_path, edit=None):
    state = lavis_state(lavis_blip2_t5_trained_keys(), hf.state_dict())
    if edit:
        edit(state)
    path = tmp_path / "blip2.pth"
    torch.save({"model": state}, path)
    return path


def test_blip2_checkpoint_without_vit_needs_vit_pretrained(hf_blip2, tiny_model_config, tmp_path):
    path = lavis_t5_file(hf_blip2[0], tmp_path)
    with pytest.raises(CheckpointError, match=r"blip2\.pth: holds no visual_encoder\.\* \(ViT\) weights.*"
                                              r"set `vit_pretrained` to LAVIS's eva_vit_g\.pth"):
        build(tiny_model_config, load_pretrained=True, pretrained=str(path))


def test_unexpected_key_is_named_with_the_skipped_list(hf_blip2, tiny_model_config, tmp_path):
    hf, _ = hf_blip2
    path = lavis_t5_file(hf, tmp_path, lambda s: s.update({"Qformer.bert.pooler.dense.weight": torch.zeros(64, 64)}))
    with pytest.raises(CheckpointError, match=r"blip2\.pth \(lavis_blip2\): 1 unexpected key\(s\): "
                                              r"Qformer\.bert\.pooler\.dense\.weight \(our connector\.qformer\.pooler\.dense\.weight\)\. "
                                              r"Keys skipped on purpose for this format: Qformer\.cls\.\*; "):
        build(tiny_model_config, vit_pretrained=eva_vit_file(hf, tmp_path), load_pretrained=True, pretrained=str(path))


def test_missing_key_is_named(hf_blip2, tiny_model_config, tmp_path):
    hf, _ = hf_blip2
    vit_path = eva_vit_file(hf, tmp_path)
    path = lavis_t5_file(hf, tmp_path, lambda s: s.pop("query_tokens"))
    with pytest.raises(CheckpointError, match=r"blip2\.pth \(lavis_blip2\): 1 key\(s\) the model needs are not in "
                                              r"the file: connector\.query_tokens$"):
        build(tiny_model_config, vit_pretrained=str(vit_path), load_pretrained=True, pretrained=str(path))
    partial_vit = tmp_path / "partial_vit.pth"
    state = torch.load(vit_path)
    del state["blocks.1.mlp.fc2.bias"]
    torch.save(state, partial_vit)
    with pytest.raises(CheckpointError, match=r"partial_vit\.pth \(eva_vit\): 1 key\(s\) .* blocks\.1\.mlp\.fc2\.bias"):
        build(tiny_model_config, vit_pretrained=str(partial_vit))


def test_shape_mismatch_names_key_and_both_shapes(hf_blip2, tiny_model_config):
    _, folder = hf_blip2
    with pytest.raises(CheckpointError, match=r"shape mismatch for query_tokens \(our connector\.query_tokens\): "
                                              r"file \(1, 8, 64\), model \(1, 4, 64\)"):
        build(tiny_model_config, num_query_token=4, load_pretrained=True, pretrained=str(folder))


def test_hf_config_that_changes_outputs_but_no_shape_is_refused(tiny_model_config, tmp_path):
    # Half the heads: every tensor keeps its shape, every output would change.
    config = tiny_hf_config()
    config.vision_config.num_attention_heads = VIT["num_heads"] // 2
    Blip2ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"config\.json describes another architecture than the model's: "
                                              r"vision_config\.num_attention_heads \(vit\.num_heads\): folder 2, model 4$"):
        build(tiny_model_config, load_pretrained=True, pretrained=str(tmp_path))


def test_vit_weights_are_set_with_vit_pretrained_not_under_vit(tiny_model_config):
    with pytest.raises(ValueError, match=r"vit\.pretrained -> vit_pretrained"):
        build(tiny_model_config, vit={"pretrained": "eva_vit_g.pth"})
