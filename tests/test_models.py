"""Registered models: presets, constructor contract, freezing, forward/backward, generation."""
from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Literal

import pytest
import torch
from torch import nn

from lavis_ds.common.registry import models as model_registry
from lavis_ds.common.registry import registry
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.models import BaseModel, Blip2Qwen, EvaViT  # importing registers the models
from lavis_ds.models.base import COMMON_KEYS
from lavis_ds.models.prompt import IGNORE_INDEX, pad_batch

# Tests follow the registry: a newly registered model and each of its presets is picked up here.
MODEL_NAMES = [name for name in model_registry if issubclass(model_registry.get(name), BaseModel)]
PRESETS = [(name, model_type) for name in MODEL_NAMES
           for model_type in model_registry.get(name).PRETRAINED_MODEL_CONFIG_DICT]

SAMPLES = {
    "instruction": [["<Img><ImageHere></Img> What is in the image?"],
                    ["Describe the picture in detail.", "What color is the ball?"]],
    "output": [["A cat sitting on a mat."], ["A dog runs on the grass.", "It is red."]],
}


def samples(batch_size: int = 2, image_size: int = 64) -> dict:
    return {"image": torch.randn(batch_size, 3, image_size, image_size),
            "instruction": SAMPLES["instruction"][:batch_size], "output": SAMPLES["output"][:batch_size]}


def trainable(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def build(cfg: dict, **overrides) -> Blip2Qwen:
    torch.manual_seed(0)
    return Blip2Qwen.from_config({**cfg, **overrides})


# ----------------------------------------------------------------- presets and the config contract
def test_the_registry_knows_both_models():
    assert registry.get_model_class("blip2_qwen") is Blip2Qwen
    assert registry.get_model_class("eva_vit_g") is EvaViT


@pytest.mark.parametrize("name,model_type", PRESETS)
def test_every_preset_validates_and_builds(name, model_type, tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    cls = registry.get_model_class(name)
    cfg = cls.default_config(model_type)
    assert cfg["arch"] == name
    errors: list[str] = []
    check_section(cfg, fields_of(cls), "model", errors, extra_keys=COMMON_KEYS)
    assert errors == []
    if "tokenizer" in fields_of(cls):
        cfg["tokenizer"] = str(tiny_tokenizer_dir)
    if "qformer_tokenizer" in (cfg.get("connector") or {}):  # InstructBLIP's Q-Former reads its BERT tokenizer
        cfg["connector"]["qformer_tokenizer"] = str(tiny_bert_tokenizer_dir)
    # Full-size presets are built on the meta device: shapes without 8B parameters of memory.
    with torch.device("cpu" if model_type == "tiny" else "meta"):
        model = cls.from_config(cfg)
    assert isinstance(model, cls) and sum(p.numel() for p in model.parameters()) > 0


ALLOWED_SCALARS = (int, float, bool, str, Any)


def plain_annotation(tp) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in ALLOWED_SCALARS or origin is Literal:
        return True
    if origin in (typing.Union, types.UnionType):
        return len(args) == 2 and type(None) in args and all(plain_annotation(a) for a in args if a is not type(None))
    if origin is list:
        return plain_annotation(args[0])
    return origin is dict and args == (str, Any)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_constructor_arguments_are_plain_keyword_only_with_defaults(name):
    """Every constructor of the chain a model's ``**kwargs`` forwards to (what the config validator reads)."""
    cls = model_registry.get(name)
    constructors = [vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c) and c is not object]
    for init in constructors:
        hints = typing.get_type_hints(init)
        params = [p for name, p in inspect.signature(init).parameters.items() if name != "self"]
        assert params
        for p in params:
            if p.kind is p.VAR_KEYWORD:
                continue  # forwarded to the next constructor, checked in its turn
            assert p.kind is p.KEYWORD_ONLY, p.name
            assert p.default is not p.empty, p.name
            assert plain_annotation(hints[p.name]), (p.name, hints[p.name])
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break


def test_minigpt4qwen_keys_are_constructor_arguments():
    keys = {"vit_model", "image_size", "drop_path_rate", "use_grad_checkpoint", "vit_precision", "freeze_vit",
            "unfreeze_pos_embed", "num_query_token", "freeze_qformer", "freeze_queries", "freeze_proj", "llm_model",
            "freeze_llm", "get_lora", "lora_r", "lora_alpha", "lora_dropout", "max_txt_len"}
    assert keys <= set(fields_of(Blip2Qwen))


def test_unknown_model_type_lists_valid_types():
    with pytest.raises(KeyError, match=r"Unknown model_type 'tinyy'.*Did you mean 'tiny'\?.*Valid model_types: .*tiny"):
        Blip2Qwen.default_config_path("tinyy")
    with pytest.raises(KeyError, match="Valid model_types: eva_vit_g, eva_clip_g, tiny"):
        EvaViT.default_config_path("vit_huge")


def test_from_config_pops_common_keys_and_accepts_dictconfig(tiny_model_config):
    """A DictConfig with the keys every model takes (``pretrained``, ``load_pretrained``) builds the model the plain
    section builds: the same parameters, the same values."""
    from omegaconf import OmegaConf

    torch.manual_seed(0)
    model = Blip2Qwen.from_config(OmegaConf.create({**tiny_model_config, "pretrained": None, "load_pretrained": False}))
    plain = build(tiny_model_config).state_dict()
    assert type(model) is Blip2Qwen and model.state_dict().keys() == plain.keys()
    assert all(torch.equal(value, plain[key]) for key, value in model.state_dict().items())


def test_vit_keys_with_a_top_level_name_are_refused_under_vit(tiny_model_config):
    """The constructor refuses in the config check's words: one rule (``settings.blip2_qwen.refused_keys``) for
    both."""
    from lavis_ds.models.settings.blip2_qwen import refused_keys

    [problem] = refused_keys({**tiny_model_config, "vit": {"img_size": 32}})
    with pytest.raises(ValueError, match="vit.img_size -> image_size") as refused:
        build(tiny_model_config, vit={"img_size": 32})
    assert str(refused.value) == problem


def test_settings_read_the_keywords_of_the_class_they_belong_to():
    """A subclass's own keyword is in its settings' arguments, not in its parent's; a class without settings is
    named, not an AttributeError."""
    from lavis_ds.common.errors import InputError
    from lavis_ds.models.settings.base import model_settings
    from lavis_ds.models.settings.blip2_qwen import Blip2QwenSettings

    class Wider(Blip2Qwen):
        def __init__(self, *, extra: int = 3, **kwargs: Any):
            super().__init__(**kwargs)

    assert model_settings(Wider, {"image_size": 96}).arguments()["extra"] == 3
    assert model_settings(Wider, {"image_size": 96}).arguments()["image_size"] == 96
    assert "extra" not in model_settings(Blip2Qwen, {}).arguments()
    # SETTINGS is the plain class the model names: its class-level facts are read without a section
    assert Wider.SETTINGS is Blip2Qwen.SETTINGS is Blip2QwenSettings and "vit_pretrained" in Wider.SETTINGS.FILE_KEYS
    with pytest.raises(InputError, match=r"model\.arch: torch\.nn\.modules\.linear\.Linear has no SETTINGS"):
        model_settings(nn.Linear, {})


# ----------------------------------------------------------------- EVA ViT
def test_tiny_eva_vit_returns_every_token_without_final_norm():
    vit = EvaViT.from_config(EvaViT.default_config("tiny"))
    out = vit(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 1 + (64 // 16) ** 2, vit.num_features) and vit.num_features == 64
    assert isinstance(vit.norm, nn.Identity) and isinstance(vit.fc_norm, nn.Identity) and isinstance(vit.head, nn.Identity)


def test_eva_vit_g_has_blip2_shapes_and_lavis_key_names():
    with torch.device("meta"):
        vit = EvaViT.from_config(EvaViT.default_config("eva_vit_g"))
    assert len(vit.blocks) == 39 and vit.num_features == 1408
    block = vit.blocks[0]
    assert block.mlp.fc1.out_features == 6144 and block.attn.num_heads == 16
    assert block.norm1.eps == 1e-6 and block.gamma_1 is None and vit.rope is None
    assert vit.pos_embed.shape == (1, 1 + 16 * 16, 1408) and vit.pos_embed.dtype == torch.float16
    names = {n for n, _ in vit.named_parameters()}
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.q_bias",
            "blocks.0.attn.v_bias", "blocks.38.mlp.fc2.bias"} <= names
    assert "blocks.0.attn.k_bias" not in names  # EVA has no k bias: timm keeps a zero buffer


def test_eva_vit_grad_checkpointing_switch():
    cfg = {**EvaViT.default_config("tiny"), "use_grad_checkpoint": True}
    vit = EvaViT.from_config(cfg)
    assert vit.grad_checkpointing
    vit(torch.randn(1, 3, 64, 64, requires_grad=True)).sum().backward()


# ----------------------------------------------------------------- Blip2Qwen structure
def test_tiny_blip2_qwen_builds_without_yaml(tiny_tokenizer_dir):
    model = Blip2Qwen(vit_model="tiny", image_size=64, vit_precision="fp32", num_query_token=4,
                      qformer={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "intermediate_size": 64},
                      llm_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "intermediate_size": 64},
                      tokenizer=str(tiny_tokenizer_dir))
    assert model.connector.query_tokens.shape == (1, 4, 32) and model.connector.llm_proj.out_features == 32
    assert model.connector.qformer.config.encoder_hidden_size == model.vision_tower.vit.num_features
    assert model.llm_model.get_input_embeddings().num_embeddings == len(model.llm.tokenizer)


def test_image_placeholders_are_replaced_by_projected_queries(tiny_model_config):
    model = build(tiny_model_config).eval()
    batch = samples()
    ids = [model.llm.prompt.training_example(i, o)[0] for i, o in zip(batch["instruction"], batch["output"])]
    n_query = tiny_model_config["num_query_token"]
    assert [row.count(model.llm.prompt.image_token_id) for row in ids] == [n_query, n_query]

    input_ids = torch.tensor([ids[0], ids[0]])
    with torch.no_grad():
        image_embeds = model.image_path.encode(batch["image"], {})
        embeds = model.image_path.embed(input_ids, image_embeds)
        token_embeds = model.llm_model.get_input_embeddings()(input_ids)
    is_image = input_ids == model.llm.prompt.image_token_id
    assert image_embeds.shape == (2, n_query, model.llm_model.config.hidden_size)
    for row in range(2):
        torch.testing.assert_close(embeds[row][is_image[row]], image_embeds[row])
        torch.testing.assert_close(embeds[row][~is_image[row]], token_embeds[row][~is_image[row]])


def test_missing_image_token_is_added_and_embeddings_resized(tiny_model_config, tiny_tokenizer):
    cfg = dict(tiny_model_config, image_token="<|vision_pad|>")
    cfg["llm_config"] = dict(cfg["llm_config"], vocab_size=len(tiny_tokenizer))
    model = build(cfg)
    assert len(model.llm.tokenizer) == len(tiny_tokenizer) + 1
    assert model.llm_model.get_input_embeddings().num_embeddings == len(model.llm.tokenizer)
    assert torch.isfinite(model(samples())["loss"])


def test_non_chatml_tokenizer_gets_the_chatml_tokens_added(tiny_model_config, tmp_path):
    # The tiny preset trains its whole LLM, so the new rows train with it (a frozen LLM: tests/test_llm.py).
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    model = build(tiny_model_config, tokenizer=str(tmp_path))
    assert model.llm.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|image_pad|>"]) == [2, 3, 4]
    assert model.llm.pad_id == 3  # no <|endoftext|> to pad with: <|im_end|> (padding is masked anyway)
    assert torch.isfinite(model(samples())["loss"])


def test_llm_model_folder_is_loaded_with_from_pretrained(tiny_model_config, tiny_tokenizer, tmp_path):
    source = build(tiny_model_config)
    source.llm_model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)  # a real Qwen folder holds both
    # tokenizer=None: read from llm_model. llm_config is ignored when weights are given.
    model = build(tiny_model_config, llm_model=str(tmp_path), tokenizer=None, llm_config={"hidden_size": 999})
    model_state = model.llm_model.state_dict()
    for name, tensor in source.llm_model.state_dict().items():
        torch.testing.assert_close(model_state[name], tensor)


# ----------------------------------------------------------------- freezing
LLM = "llm_model."
FREEZE_CASES = {
    "minigpt4qwen": ({}, lambda n: n.startswith("connector.llm_proj.")),
    "pos_embed": ({"unfreeze_pos_embed": True},
                  lambda n: n.startswith("connector.llm_proj.") or n == "vision_tower.vit.pos_embed"),
    "queries": ({"freeze_queries": False},
                lambda n: n.startswith("connector.llm_proj.") or n == "connector.query_tokens"),
    "qformer": ({"freeze_qformer": False},
                lambda n: n.startswith(("connector.llm_proj.", "connector.qformer.", "connector.ln_vision."))),
    "llm_only": ({"freeze_proj": True, "freeze_llm": False}, lambda n: n.startswith(LLM)),
    "lora": ({"get_lora": True}, lambda n: n.startswith("connector.llm_proj.") or ".lora_" in n),
}
MINIGPT4QWEN_FREEZE = {"freeze_vit": True, "freeze_qformer": True, "freeze_queries": True, "freeze_proj": False,
                       "freeze_llm": True}


@pytest.mark.parametrize("case", FREEZE_CASES)
def test_freeze_switches_select_the_trainable_parameters(case, tiny_model_config):
    overrides, expected = FREEZE_CASES[case]
    model = build(tiny_model_config, **{**MINIGPT4QWEN_FREEZE, **overrides})
    names = {n for n, _ in model.named_parameters()}
    assert trainable(model) == {n for n in names if expected(n)}
    assert trainable(model)

    model.train()
    assert model.training and not model.vision_tower.vit.training
    assert model.connector.qformer.training is (case == "qformer")
    # LoRA needs train mode (dropout); a plain frozen LLM stays in eval.
    assert model.llm_model.training is (case in ("llm_only", "lora"))
    model.eval()
    assert not any(m.training for m in model.modules())


def test_lora_targets_every_qwen2_linear_layer(tiny_model_config):
    model = build(tiny_model_config, get_lora=True, freeze_llm=True, lora_r=2, lora_alpha=4)
    adapted = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[1] for n in trainable(model) if ".lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    model = build(tiny_model_config, get_lora=True, freeze_llm=True, lora_target_modules=["q_proj", "v_proj"])
    assert {n.split(".lora_A")[0].rsplit(".", 1)[1] for n in trainable(model) if ".lora_A" in n} == {"q_proj", "v_proj"}
    assert torch.isfinite(model(samples())["loss"])


def test_lora_without_frozen_llm_is_refused(tiny_model_config):
    # The config check's line (test_config_mutations.py): one rule, one wording.
    with pytest.raises(ValueError, match=r"^model\.get_lora: true trains only the LoRA adapters, so it needs "
                                         r"model\.freeze_llm: true$"):
        build(tiny_model_config, get_lora=True, freeze_llm=False)


def test_all_switches_off_trains_everything(tiny_model_config):
    model = build(tiny_model_config)  # the tiny preset freezes nothing
    assert trainable(model) == {n for n, _ in model.named_parameters()}


# ----------------------------------------------------------------- forward / backward
def test_forward_loss_is_the_mean_over_answer_tokens(tiny_model_config):
    model = build(tiny_model_config).eval()  # eval: no dropout, so sample-wise and batched runs agree
    batch = samples()
    out = model(batch)
    expected_tokens = sum(
        sum(lab != IGNORE_INDEX for lab in model.llm.prompt.training_example(i, o)[1])
        for i, o in zip(batch["instruction"], batch["output"]))
    assert out["num_tokens"].item() == expected_tokens
    assert out["loss"].dtype == out["loss_sum"].dtype == torch.float32
    torch.testing.assert_close(out["loss"], out["loss_sum"] / out["num_tokens"])
    # Same number as Hugging Face's own shifted causal-LM loss on the same inputs.
    examples = [model.llm.prompt.training_example(i, o) for i, o in zip(batch["instruction"], batch["output"])]
    input_ids, attention_mask = pad_batch([e[0] for e in examples], model.llm.pad_id, "right")
    labels, _ = pad_batch([e[1] for e in examples], IGNORE_INDEX, "right")
    with torch.no_grad():
        embeds = model.image_path.embed(input_ids, model.image_path.encode(batch["image"], {}))
        hf = model.llm_model(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels).loss
    torch.testing.assert_close(out["loss"].detach(), hf, rtol=1e-5, atol=1e-5)
    # Right padding must not leak into the loss: the batch sums to its samples' sums.
    singles = [model({k: v[i:i + 1] for k, v in batch.items()}) for i in range(2)]
    torch.testing.assert_close(out["loss_sum"], sum(s["loss_sum"] for s in singles), rtol=1e-4, atol=1e-4)


def test_forward_backward_fp32(tiny_model_config):
    model = build(tiny_model_config).train()
    out = model(samples())
    assert torch.isfinite(out["loss"]) and out["loss"].requires_grad
    out["loss"].backward()
    for name in ("connector.llm_proj.weight", "connector.query_tokens", "vision_tower.vit.patch_embed.proj.weight",
                 "connector.ln_vision.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


@pytest.mark.parametrize("switches", [{"freeze_llm": True}, {"freeze_llm": True, "get_lora": True},
                                      {"freeze_llm": False, "llm_config": {"attention_dropout": 0.1}}],
                         ids=["frozen_llm", "lora", "trained_llm_with_dropout"])
def test_llm_grad_checkpoint_recomputes_each_layer_with_the_same_loss_and_gradients(tiny_model_config, switches):
    llm_config = {**tiny_model_config["llm_config"], **switches.pop("llm_config", {})}
    results = {}
    for checkpointed in (False, True):
        model = build(tiny_model_config, llm_config=llm_config, llm_grad_checkpoint=checkpointed, **switches).train()
        layers = model.llm_model.get_base_model().model.layers if switches.get("get_lora") \
            else model.llm_model.model.layers
        calls = []
        for layer in layers:  # a pre-hook: the recomputation stops once it has what backward needs
            layer.input_layernorm.register_forward_pre_hook(lambda *_: calls.append(1))
        torch.manual_seed(1)  # the same dropout masks in both runs
        loss = model(samples())["loss"]
        forwards = len(calls)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[checkpointed] = (loss.detach(), grads, forwards, len(calls) - forwards)
    (loss, grads, forwards, recomputed), (loss_c, grads_c, forwards_c, recomputed_c) = results.values()
    assert (recomputed, recomputed_c) == (0, forwards_c) and forwards == forwards_c == len(layers)
    torch.testing.assert_close(loss_c, loss, rtol=0, atol=0)
    assert grads_c.keys() == grads.keys() and "connector.llm_proj.weight" in grads
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # Evaluation never recomputes (nor keeps anything to recompute from).
    model.eval()
    calls.clear()
    with torch.no_grad():
        model(samples())
    assert len(calls) == len(layers)


def test_forward_backward_bf16_module_under_autocast(tiny_model_config):
    model = build(tiny_model_config).to(torch.bfloat16).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(samples())
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    out["loss"].backward()
    grad = model.connector.llm_proj.weight.grad
    assert grad is not None and grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()


def test_forward_bf16_parameters_without_autocast(tiny_model_config):
    # DeepSpeed's bf16 engine (ZeRO 0-2) casts the parameters only: buffers stay fp32, and so
    # do the images of the data loader.
    batch = samples()
    reference = build(tiny_model_config, freeze_vit=True, freeze_llm=True)(batch)["loss"].item()
    model = build(tiny_model_config, freeze_vit=True, freeze_llm=True)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    out = model(batch)
    assert out["loss"].item() == pytest.approx(reference, rel=5e-3)  # the fp32 model's loss, to bf16's precision
    out["loss"].backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_answers_truncated_away_give_zero_loss_not_nan(tiny_model_config):
    model = build(tiny_model_config)
    n_prompt = len(model.llm.prompt.generation_prompt(SAMPLES["instruction"][0]))
    model = build(tiny_model_config, max_txt_len=n_prompt)
    out = model({**samples(1)})
    assert out["num_tokens"].item() == 0 and out["loss"].item() == 0.0


# ----------------------------------------------------------------- generation
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_returns_one_string_per_sample(num_beams, tiny_model_config, monkeypatch):
    model = build(tiny_model_config).eval()
    hf_generate, shapes = model.llm_model.generate, []

    def recording_generate(**kwargs):
        tokens = hf_generate(**kwargs)
        shapes.append(tokens.shape)
        return tokens

    monkeypatch.setattr(model.llm_model, "generate", recording_generate)
    texts = model.generate(samples(), num_beams=num_beams, max_new_tokens=6)
    assert isinstance(texts, list) and len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert all(t == t.strip() for t in texts)
    # Only the new tokens are decoded, never the prompt.
    assert shapes[0][0] == 2 and shapes[0][1] <= 6


def test_generate_left_padding_does_not_change_greedy_output(tiny_model_config):
    model = build(tiny_model_config).eval()
    batch = samples()
    together = model.generate(batch, max_new_tokens=6)
    alone = [model.generate({k: v[i:i + 1] for k, v in batch.items()}, max_new_tokens=6)[0] for i in range(2)]
    assert together == alone


def test_generate_without_outputs(tiny_model_config):
    model = build(tiny_model_config).eval()
    batch = {k: v for k, v in samples(1).items() if k != "output"}
    assert len(model.generate(batch, max_new_tokens=3)) == 1


def test_fp16_vision_tower_in_an_fp32_model(tiny_model_config):
    # The full-size presets keep the frozen ViT in fp16 (vit_precision), the rest in fp32.
    model = build(tiny_model_config, vit_precision="fp16", freeze_vit=True)
    assert model.vision_tower.vit.pos_embed.dtype == torch.float16 and model.connector.llm_proj.weight.dtype == torch.float32
    out = model(samples())
    assert torch.isfinite(out["loss"])
    out["loss"].backward()
    assert torch.isfinite(model.connector.llm_proj.weight.grad).all()
