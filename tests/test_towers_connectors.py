"""Vision towers and connectors against the transformers classes they stand in for (tiny random models, fp32)."""
from __future__ import annotations

import importlib
import math
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import (CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModel, InstructBlipConfig,
                          InstructBlipForConditionalGeneration, LlavaConfig, LlavaForConditionalGeneration,
                          LlavaModel, Qwen2Config, Qwen2ForCausalLM, SiglipVisionConfig, SiglipVisionModel)

import lavis_ds  # noqa: F401  (fills the registries)
from lavis_ds.common.registry import connectors, registry, vision_towers
from lavis_ds.models import hf_keys
from lavis_ds.models.connectors.qformer import InstructQFormerConnector
from lavis_ds.models.parts import PartError, build_part
from lavis_ds.models.towers.eva import EvaTower

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
              patch_size=14)
TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)


def tiny_clip_folder(tmp_path, kind: str):
    """A tiny published folder as each class's save_pretrained writes it."""
    torch.manual_seed(0)
    folder = tmp_path / kind
    if kind == "clip_vision":
        CLIPVisionModel(CLIPVisionConfig(**VISION, hidden_act="quick_gelu")).save_pretrained(folder)
    elif kind == "clip_full":
        text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
        CLIPModel(CLIPConfig(vision_config={**VISION, "hidden_act": "quick_gelu"}, text_config=text)).save_pretrained(
            folder)
    else:
        SiglipVisionModel(SiglipVisionConfig(**VISION)).save_pretrained(folder)
    return folder


def llava_reference(folder, kind: str, layer, strategy: str) -> LlavaModel:
    """transformers' LlavaModel with the folder's tower: the reference the tower + mlp2x_gelu must reproduce."""
    model_class = SiglipVisionModel if kind == "siglip" else CLIPVisionModel
    tower = model_class.from_pretrained(folder)
    config = LlavaConfig(vision_config=tower.config, text_config=Qwen2Config(**TEXT), image_token_index=127,
                         vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    llava = LlavaModel(config).eval()
    llava.vision_tower.load_state_dict(tower.state_dict())
    return llava


@pytest.mark.parametrize("kind", ["clip_vision", "clip_full", "siglip"])
@pytest.mark.parametrize("layer,strategy", [(-2, "default"), ([-3, -1], "full"), ([0, 2], "default")])
def test_tower_and_mlp2x_gelu_give_llava_image_features(tmp_path, kind, layer, strategy):
    folder = tiny_clip_folder(tmp_path, kind)
    reference = llava_reference(folder, kind, layer, strategy)
    name = "siglip" if kind == "siglip" else "clip"
    tower = build_part(vision_towers, {"name": name, "preset": "tiny", "pretrained": str(folder),
                                       "vision_feature_layer": layer, "vision_feature_select_strategy": strategy},
                       "model.vision_tower").eval()
    connector = build_part(connectors, {"name": "mlp2x_gelu"}, "model.connector", vision_width=tower.num_features,
                           llm_width=TEXT["hidden_size"])
    connector.load_state_dict(reference.multi_modal_projector.state_dict())

    images = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        ours = connector(tower(images))
        theirs = torch.stack(list(reference.get_image_features(
            pixel_values=images, vision_feature_layer=layer, vision_feature_select_strategy=strategy).pooler_output))
    assert ours.shape == (2, tower.num_tokens, TEXT["hidden_size"])
    assert connector.tokens_per_image(tower.num_tokens) == ours.shape[1]
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert not any(p.requires_grad for p in tower.parameters())  # towers are frozen unless freeze: false


def test_unfrozen_tower_trains_only_what_the_features_use(tmp_path):
    tower = build_part(vision_towers, {"name": "clip", "preset": "tiny", "freeze": False, "vision_feature_layer": -2},
                       "model.vision_tower")
    tower(torch.randn(1, 3, 56, 56)).sum().backward()
    trainable = {n for n, p in tower.named_parameters() if p.requires_grad}
    assert trainable and all(tower.get_parameter(n).grad is not None for n in trainable)
    assert not any(".layers.2." in n or "post_layernorm" in n for n in trainable)  # layer -2 skips the last


def test_mlp2x_gelu_equals_llava_projector_without_bias():
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=Qwen2Config(**TEXT),
                         multimodal_projector_bias=False)
    reference = LlavaMultiModalProjector(config)
    ours = build_part(connectors, {"name": "mlp2x_gelu", "multimodal_projector_bias": False}, "connector",
                      vision_width=32, llm_width=48)
    ours.load_state_dict(reference.state_dict())  # same names: linear_1, linear_2, no biases
    features = torch.randn(2, 5, 32)
    torch.testing.assert_close(ours(features), reference(features), atol=1e-6, rtol=0)


# ----------------------------------------------------------------- InstructBLIP
QFORMER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=120)
EVA = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=64,
           patch_size=16)


def tiny_instructblip_folder(tmp_path):
    torch.manual_seed(0)
    config = InstructBlipConfig(vision_config=EVA, qformer_config={**QFORMER, "encoder_hidden_size": 64},
                                text_config=Qwen2Config(**TEXT).to_dict(), num_query_tokens=4)
    model = InstructBlipForConditionalGeneration(config).eval()
    with torch.no_grad():  # random, not zero: a k part of qkv.bias that our EVA drops must not matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(tmp_path / "instructblip")
    return model, tmp_path / "instructblip"


def instruct_parts(folder=None, connector_file=None):
    tower = EvaTower(preset="tiny")
    connector = InstructQFormerConnector(vision_width=tower.num_features, llm_width=TEXT["hidden_size"],
                                         num_query_token=4, qformer=QFORMER, ln_vision_eps=1e-6)
    if folder is not None:
        tower.load_pretrained(str(folder))
        connector.load_pretrained(str(connector_file or folder))
    return tower.eval(), connector.eval()


def test_instruct_qformer_equals_transformers_instructblip_image_features(tmp_path):
    reference, folder = tiny_instructblip_folder(tmp_path)
    tower, connector = instruct_parts(folder)
    images = torch.randn(2, 3, 64, 64)
    ids = torch.tensor([[101, 7, 8, 9, 102], [101, 11, 102, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        ours = connector(tower(images), {"qformer_input_ids": ids, "qformer_attention_mask": mask})
        theirs = reference.get_image_features(pixel_values=images, qformer_input_ids=ids,
                                              qformer_attention_mask=mask).pooler_output
    assert ours.shape == (2, 4, TEXT["hidden_size"])
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    # the instruction matters: other words, other query outputs
    with torch.no_grad():
        other = connector(tower(images), {"qformer_input_ids": ids.flip(1) * mask, "qformer_attention_mask": mask})
    assert not torch.allclose(ours, other)


def lavis_instruct_state(hf_state):
    """The LAVIS blip2_vicuna_instruct .pth layout of an HF InstructBLIP state (LAVIS's own module names)."""
    renames = ((r"^vision_model\.post_layernorm\.", "ln_vision."), (r"^language_projection\.", "llm_proj."),
               (r"^qformer\.embeddings\.layernorm\.", "Qformer.bert.embeddings.LayerNorm."),
               (r"\.(attention|crossattention)\.attention\.", r".\1.self."), (r"^qformer\.", "Qformer.bert."))
    out = {}
    for key, value in hf_state.items():
        if key.startswith(("language_model.", "vision_model.")) and "post_layernorm" not in key:
            continue
        for pattern, replacement in renames:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    out["Qformer.bert.embeddings.position_ids"] = torch.arange(512)[None]
    return {"model": out}


def test_lavis_instructblip_pth_loads_the_same_parts(tmp_path):
    reference, folder = tiny_instructblip_folder(tmp_path)
    tower_hf, from_hf = instruct_parts(folder)
    lavis = lavis_instruct_state(reference.state_dict())
    lavis["model"].update({f"visual_encoder.{k}": v for k, v in tower_hf.vit.state_dict().items()})  # LAVIS's EVA names
    torch.save(lavis, tmp_path / "instruct_blip.pth")
    tower_lavis, from_lavis = instruct_parts(tmp_path / "instruct_blip.pth")
    for ours, theirs in ((from_hf, from_lavis), (tower_hf, tower_lavis)):
        hf, lv = ours.state_dict(), theirs.state_dict()
        assert hf.keys() == lv.keys()
        assert all(torch.equal(hf[k], lv[k]) for k in hf)


def test_qformer_connector_equals_transformers_blip2_image_features(tmp_path):
    from transformers import Blip2Config, Blip2ForConditionalGeneration

    torch.manual_seed(0)
    config = Blip2Config(vision_config=EVA, qformer_config={**QFORMER, "encoder_hidden_size": 64},
                         text_config=Qwen2Config(**TEXT).to_dict(), num_query_tokens=4)
    reference = Blip2ForConditionalGeneration(config).eval()
    reference.save_pretrained(tmp_path / "blip2")
    tower = build_part(vision_towers, {"name": "eva_vit_g", "preset": "tiny", "pretrained": str(tmp_path / "blip2")},
                       "model.vision_tower")
    connector = build_part(connectors, {"name": "qformer", "num_query_token": 4, "qformer": QFORMER,
                                        "ln_vision_eps": 1e-6, "pretrained": str(tmp_path / "blip2")},
                           "model.connector", vision_width=tower.num_features, llm_width=TEXT["hidden_size"]).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        theirs = reference.get_image_features(pixel_values=images).pooler_output
        torch.testing.assert_close(connector(tower(images)), theirs, atol=1e-6, rtol=0)
    assert len(connector.blocks()) == 2 and len(tower.blocks()) == 2

    # LAVIS's BLIP-2 .pth of the same bridge: stage-1 keys (text embeddings, text FFN, heads) skipped, no llm_proj
    renames = ((r"^vision_model\.post_layernorm\.", "ln_vision."),
               (r"^qformer\.layernorm\.", "Qformer.bert.embeddings.LayerNorm."),
               (r"\.(attention|crossattention)\.attention\.", r".\1.self."), (r"^qformer\.", "Qformer.bert."))
    lavis = {}
    for key, value in reference.state_dict().items():
        if key.startswith(("qformer.", "query_tokens", "vision_model.post_layernorm.")):
            for pattern, replacement in renames:
                key = re.sub(pattern, replacement, key)
            lavis[key] = value
    lavis.update({"Qformer.bert.embeddings.word_embeddings.weight": torch.zeros(120, 32), "temp": torch.tensor(0.07),
                  "Qformer.bert.encoder.layer.0.intermediate.dense.weight": torch.zeros(64, 32),
                  "Qformer.cls.predictions.bias": torch.zeros(120), "opt_proj.weight": torch.zeros(8, 32)})
    torch.save({"model": lavis}, tmp_path / "blip2_pretrained.pth")
    from_lavis = build_part(connectors, {"name": "qformer", "num_query_token": 4, "qformer": QFORMER,
                                         "ln_vision_eps": 1e-6, "pretrained": str(tmp_path / "blip2_pretrained.pth")},
                            "model.connector", vision_width=64, llm_width=TEXT["hidden_size"])
    ours, theirs = connector.state_dict(), from_lavis.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if not k.startswith("llm_proj."))


def bert_tokenizer_folder(tmp_path):
    from transformers import BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "in", "the", "image", "?", "a", "cat"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = BertTokenizer(str(tmp_path / "vocab.txt"))
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})  # as LAVIS and InstructBLIP's qformer_tokenizer
    tokenizer.save_pretrained(tmp_path / "qformer_tokenizer")
    return tmp_path / "qformer_tokenizer"


def test_instruct_qformer_tokenizes_each_images_instruction(tmp_path):
    folder = bert_tokenizer_folder(tmp_path)
    connector = build_part(connectors, {"name": "instruct_qformer", "qformer_tokenizer": str(folder),
                                        "num_query_token": 4, "qformer": QFORMER}, "connector",
                           vision_width=64, llm_width=48)
    samples = {"instruction": [["<Img><ImageHere></Img> what is in the image?", "a cat?"], "what is <ImageHere> a cat"],
               "num_images": [1, 1], "image": torch.zeros(2, 3, 64, 64)}
    inputs = connector.prepare(samples)
    expected = connector.tokenizer(["what is in the image?", "what is a cat"], padding="longest", return_tensors="pt")
    assert torch.equal(inputs["qformer_input_ids"], expected["input_ids"])
    assert torch.equal(inputs["qformer_attention_mask"], expected["attention_mask"])
    out = connector(torch.randn(2, 17, 64), inputs)
    assert out.shape == (2, 4, 48)


def test_the_tiny_qformer_tokenizer_is_the_same_files_on_every_build(tmp_path):
    """The Q-Former's word embeddings are indexed by its ids: a vocabulary numbered otherwise on another build (as
    tokenizers' WordPieceTrainer numbers it, in its hash maps' order) is another model from the same seed."""
    from transformers import AutoTokenizer

    from lavis_ds.models.tokenizer import train_bert_tokenizer

    texts = ["A dog runs on the grass next to a red ball.", "What color is the ball? It is red."] * 3
    first, second = (train_bert_tokenizer(texts, tmp_path / name, vocab_size=80) for name in ("first", "second"))
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    assert all((first / p.name).read_bytes() == (second / p.name).read_bytes() for p in first.iterdir())
    tokenizer = AutoTokenizer.from_pretrained(first)
    # A word of the texts is one token; another word of their letters splits into them; bos is [DEC].
    assert tokenizer.tokenize("What ball") == ["what", "ball"]
    assert tokenizer.tokenize("Grad") == ["g", "##r", "##a", "##d"] and tokenizer.bos_token == "[DEC]"
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        train_bert_tokenizer(texts, tmp_path / "small", vocab_size=10)


# ----------------------------------------------------------------- LLaVA checkpoints
def test_llava_folder_and_mm_projector_split_into_parts(tmp_path):
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION), text_config=Qwen2Config(**TEXT),
                         image_token_index=127)
    llava = LlavaForConditionalGeneration(config)
    llava.save_pretrained(tmp_path / "llava")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "llava" / "model.safetensors")
    # the transformers 4.52-4.x layout of the same weights
    older = {re.sub(r"^vision_tower\.", "model.vision_tower.vision_model.",
                    re.sub(r"^multi_modal_projector\.", "model.multi_modal_projector.",
                           re.sub(r"^language_model\.model\.", "model.language_model.",
                                  re.sub(r"^language_model\.lm_head\.", "lm_head.", k)))): v for k, v in saved.items()}
    for state in (saved, older):
        tower = build_part(vision_towers, {"name": "clip", "preset": "tiny", "vision_config": VISION}, "t")
        tower.model.load_state_dict(hf_keys.hf_vision_keys(hf_keys.llava_tower(state), tower.model), strict=True)
        connector = build_part(connectors, {"name": "mlp2x_gelu"}, "c", vision_width=32, llm_width=48)
        connector.load_state_dict(hf_keys.llava_projector(state), strict=True)
        llm = hf_keys.llava_llm(state)
        assert llm.keys() == Qwen2ForCausalLM(Qwen2Config(**TEXT)).state_dict().keys()
        images = torch.randn(1, 3, 56, 56)
        with torch.no_grad():
            theirs = llava.model.get_image_features(pixel_values=images).pooler_output[0]
            torch.testing.assert_close(connector(tower(images))[0], theirs, atol=1e-6, rtol=0)

    # the tower and the connector read a LLaVA folder as their `pretrained`, and LLaVA's stage-1 mm_projector.bin
    tower = build_part(vision_towers, {"name": "clip", "preset": "tiny", "pretrained": str(tmp_path / "llava")}, "t")
    assert all(torch.equal(v, llava.model.vision_tower.state_dict()[k]) for k, v in tower.model.state_dict().items())
    from_folder = build_part(connectors, {"name": "mlp2x_gelu", "pretrained": str(tmp_path / "llava")}, "c",
                             vision_width=32, llm_width=48)
    projector = llava.model.multi_modal_projector.state_dict()
    torch.save({"model.mm_projector.0.weight": projector["linear_1.weight"], "model.mm_projector.0.bias":
                projector["linear_1.bias"], "model.mm_projector.2.weight": projector["linear_2.weight"],
                "model.mm_projector.2.bias": projector["linear_2.bias"]}, tmp_path / "mm_projector.bin")
    from_bin = build_part(connectors, {"name": "mlp2x_gelu", "pretrained": str(tmp_path / "mm_projector.bin")}, "c",
                          vision_width=32, llm_width=48)
    for loaded in (from_folder, from_bin):
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in projector.items())
    # LLaVA-1.0's single-Linear projector into the `linear` connector
    torch.save({"model.mm_projector.weight": projector["linear_1.weight"], "model.mm_projector.bias":
                projector["linear_1.bias"]}, tmp_path / "linear_projector.bin")
    linear = build_part(connectors, {"name": "linear", "pretrained": str(tmp_path / "linear_projector.bin")}, "c",
                        vision_width=32, llm_width=48)
    assert torch.equal(linear.proj.weight, projector["linear_1.weight"])


# ----------------------------------------------------------------- bad input, one line each
def test_siglip_folder_configured_as_clip_names_its_model_type(tmp_path):
    folder = tiny_clip_folder(tmp_path, "siglip")
    with pytest.raises(PartError, match=r"model_type 'siglip_vision_model', but the clip tower reads model_type "
                                        r"'clip' or 'clip_vision_model'.*use vision tower 'siglip'"):
        build_part(vision_towers, {"name": "clip", "pretrained": str(folder)}, "model.vision_tower")


def test_image_size_the_tower_cannot_take_names_the_one_it_takes():
    with pytest.raises(PartError, match=r"image_size: 60 is a size the clip tower cannot take; it takes 56 only"):
        build_part(vision_towers, {"name": "clip", "preset": "tiny", "image_size": 60}, "model.vision_tower")
    with pytest.raises(PartError, match=r"image_size: 70 is a size the eva_vit_g tower cannot take; it takes "
                                        r"multiples of its patch size 16 \(e\.g\. 64\)"):
        build_part(vision_towers, {"name": "eva_vit_g", "preset": "tiny", "image_size": 70}, "model.vision_tower")
    tower = build_part(vision_towers, {"name": "eva_vit_g", "preset": "tiny", "image_size": 96}, "model.vision_tower")
    assert tower.num_tokens == 37 and tower(torch.randn(1, 3, 96, 96)).shape == (1, 37, 64)


def test_connector_name_typo_suggests_the_registered_name():
    with pytest.raises(PartError, match=r"model\.connector\.name: Unknown connector 'mlp2x_gelo'\. "
                                        r"Did you mean 'mlp2x_gelu'\?"):
        build_part(connectors, {"name": "mlp2x_gelo"}, "model.connector", vision_width=8, llm_width=8)


def test_unknown_part_key_suggests_the_valid_one():
    with pytest.raises(PartError, match=r"model\.vision_tower\.vision_feature_layers: unknown key; did you mean "
                                        r"'vision_feature_layer'\?"):
        build_part(vision_towers, {"name": "clip", "vision_feature_layers": -2}, "model.vision_tower")


def test_instruct_qformer_without_its_tokenizer_folder(tmp_path):
    section = {"name": "instruct_qformer", "qformer": QFORMER, "qformer_tokenizer": str(tmp_path / "nope")}
    with pytest.raises(PartError, match=r"connector\.qformer_tokenizer: .*nope is not a tokenizer folder; expected "
                                        r"the Q-Former's BERT tokenizer.*qformer_tokenizer/"):
        build_part(connectors, section, "connector", vision_width=64, llm_width=48)
    with pytest.raises(PartError, match=r"connector\.qformer_tokenizer: required"):
        build_part(connectors, {"name": "instruct_qformer", "qformer": QFORMER}, "connector", vision_width=64,
                   llm_width=48)


# ----------------------------------------------------------------- a user's part, the registry kinds
def test_users_connector_registered_from_a_module_is_found_by_name():
    importlib.import_module("user_connector")  # what `imports: [user_connector]` does
    assert "avgpool2x2_mlp" in connectors
    connector = build_part(connectors, {"name": "avgpool2x2_mlp", "hidden": 16}, "model.connector",
                           vision_width=32, llm_width=48)
    tower = build_part(vision_towers, {"name": "clip", "preset": "tiny"}, "model.vision_tower")
    out = connector(tower(torch.randn(2, 3, 56, 56)))
    assert tower.num_tokens == 16 and out.shape == (2, connector.tokens_per_image(16), 48) == (2, 4, 48)


def test_registry_kinds_have_the_lavis_spelling():
    assert registry.get_vision_tower_class("clip") is vision_towers.get("clip")
    assert registry.get_connector_class("qformer") is connectors.get("qformer")
    assert {"eva_vit_g", "clip", "siglip"} <= set(vision_towers)
    assert {"qformer", "instruct_qformer", "mlp2x_gelu", "linear", "patch_merger"} <= set(connectors)
    assert {"qwen2_vl", "qwen2_5_vl"} <= set(vision_towers)


def test_tower_processing_pads_to_square_with_the_mean_colour():
    from PIL import Image

    tower = build_part(vision_towers, {"name": "clip", "preset": "tiny", "pad_to_square": True}, "t")
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    pixels = tower.processing.transform()(image)
    assert pixels.shape == (3, 56, 56)
    top = pixels[:, 0, 28] * torch.tensor(tower.processing.std) + torch.tensor(tower.processing.mean)
    assert torch.allclose(top * 255, torch.tensor(tower.processing.pad_colour, dtype=torch.float), atol=1.5)


# ----------------------------------------------------------------- every registered part, by name
TINY_TOWERS = {"eva_vit_g": {"preset": "tiny"}, "clip": {"preset": "tiny"}, "siglip": {"preset": "tiny"}}
TINY_CONNECTORS = {"qformer": {"num_query_token": 4, "qformer": QFORMER}, "mlp2x_gelu": {}, "linear": {},
                   "instruct_qformer": {"num_query_token": 4, "qformer": QFORMER}}


TINY_FLAT_TOWERS = {"qwen2_vl": {"preset": "tiny"}, "qwen2_5_vl": {"preset": "tiny"}, "qwen3_vl": {"preset": "tiny"}}
# qwen3_vl_merger without DeepStack mergers here (a tower's plain features); with them: test_qwen3_vl
TINY_FLAT_CONNECTORS = {"patch_merger": {}, "qwen3_vl_merger": {"deepstack_taps": 0}}


def pairs(flat: bool) -> list[tuple[str, str]]:
    """Every registered tower with every registered connector of the same feature layout: ``[N, T, C]`` per image,
    or flat patches of images of their own sizes (``FLAT_FEATURES``: the Qwen-VL parts), which only each other's
    kind can read."""
    return [(t, c) for t in vision_towers for c in connectors
            if vision_towers.get(t).FLAT_FEATURES is flat and connectors.get(c).FLAT_FEATURES is flat]


@pytest.mark.parametrize("tower_name,connector_name", pairs(flat=False))
def test_every_tower_feeds_every_connector(tmp_path, tower_name, connector_name):
    assert tower_name in TINY_TOWERS and connector_name in TINY_CONNECTORS, "give the new part a tiny section here"
    """... and each reports its own FLOPs per image as FlopCounterMode measures them (the tower trained here; frozen
    towers in test_flops), forward and training."""
    tower = build_part(vision_towers, {"name": tower_name, **TINY_TOWERS[tower_name], "freeze": False},
                       "model.vision_tower")
    section = {"name": connector_name, **TINY_CONNECTORS[connector_name]}
    if connector_name == "instruct_qformer":
        section["qformer_tokenizer"] = str(bert_tokenizer_folder(tmp_path))
    connector = build_part(connectors, section, "model.connector", vision_width=tower.num_features, llm_width=48)
    samples = {"instruction": ["what is in the image?", "a cat"], "image": torch.randn(2, 3, tower.image_size,
                                                                                         tower.image_size)}
    inputs = connector.prepare(samples)
    with sdpa_kernel(SDPBackend.MATH):  # torch counts no FLOPs for CPU's fused attention kernel
        with FlopCounterMode(display=False) as forward:
            features = tower(samples["image"])
            assert features.shape == (2, tower.num_tokens, tower.num_features)
            out = connector(features, inputs)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
    assert out.shape == (2, connector.tokens_per_image(tower.num_tokens), 48)
    assert all(p.grad is not None for p in connector.parameters() if p.requires_grad)  # the whole connector trains
    tower_flops, features_grad = tower.flops()
    text = inputs["qformer_input_ids"].shape[1] if inputs else 0
    connector_flops, out_grad = connector.flops(tower.num_tokens, features_grad, text)
    assert features_grad and out_grad
    expected = (tower_flops + connector_flops) * 2
    assert forward.get_total_flops() == pytest.approx(expected.forward, rel=1e-9)
    assert forward.get_total_flops() + backward.get_total_flops() == pytest.approx(expected.training, rel=1e-9)


def test_freeze_switches_of_the_qformer_connector():
    def trainable(section):
        connector = build_part(connectors, {"name": "qformer", "num_query_token": 4, "qformer": QFORMER, **section},
                               "connector", vision_width=64, llm_width=48)
        connector.train()
        return {n.split(".")[0] for n, p in connector.named_parameters() if p.requires_grad}, connector

    assert trainable({})[0] == {"ln_vision", "qformer", "query_tokens", "llm_proj"}
    assert trainable({"freeze_qformer": True, "freeze_queries": True})[0] == {"llm_proj"}  # BLIP-2's recipe
    assert trainable({"freeze_proj": True})[0] == {"ln_vision", "qformer", "query_tokens"}
    frozen, connector = trainable({"freeze": True})
    assert frozen == set() and not connector.training and not connector.qformer.training  # eval despite train()


@pytest.mark.parametrize("tower_name,connector_name", pairs(flat=True))
def test_every_flat_tower_feeds_every_flat_connector(tower_name, connector_name):
    """... images of three sizes at once, and FLOPs per image (linear in its patches, quadratic in its attention
    spans) as FlopCounterMode measures them, the tower trained, forward and training."""
    assert tower_name in TINY_FLAT_TOWERS and connector_name in TINY_FLAT_CONNECTORS, "give the part a tiny section"
    tower = build_part(vision_towers, {"name": tower_name, **TINY_FLAT_TOWERS[tower_name], "freeze": False},
                       "model.vision_tower")
    connector = build_part(connectors, {"name": connector_name, **TINY_FLAT_CONNECTORS[connector_name]},
                           "model.connector", vision_width=tower.num_features, llm_width=48)
    grid = torch.tensor([[1, 12, 18], [2, 8, 4], [1, 2, 2]])  # windows cut by the edges (Qwen2.5-VL's 8x8 patches)
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, math.prod(tower.patch_embed.kernel))
    with sdpa_kernel(SDPBackend.MATH):  # torch counts no FLOPs for CPU's fused attention kernel
        with FlopCounterMode(display=False) as forward:
            features = tower(pixels, grid)
            out = connector(features)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
    tokens = [tower.tokens_for_grid(g) for g in grid]
    assert features.shape == (patches, tower.num_features) and out.shape == (sum(tokens), 48)
    assert [connector.tokens_per_image(int(g.prod())) for g in grid] == tokens
    assert all(p.grad is not None for p in [*tower.parameters(), *connector.parameters()])
    tower_flops, features_grad = tower.flops_for_grid(grid)
    per_image = [tower.flops_for_grid(g[None])[0] for g in grid]
    assert sum(f.training for f in per_image) == pytest.approx(tower_flops.training, rel=1e-12)  # sums per image
    connector_flops = [connector.flops(int(g.prod()), features_grad)[0] for g in grid]
    expected = sum(connector_flops[1:], tower_flops + connector_flops[0])
    assert forward.get_total_flops() == pytest.approx(expected.forward, rel=1e-9)
    assert forward.get_total_flops() + backward.get_total_flops() == pytest.approx(expected.training, rel=1e-9)
