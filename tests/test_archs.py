"""Every registered composed architecture (tower + connector + LLM) by name: its tiny preset builds, trains one step
on the trainable parts only, generates; a mix no preset has trains; the config check reports bad part sections."""
from __future__ import annotations

import math

import pytest
import torch
import yaml

import lavis_ds  # noqa: F401  (fills the registries)
from archs import image_side
from lavis_ds.common.errors import ConfigError
from lavis_ds.common.registry import connectors, models, registry
from lavis_ds.models.settings.base import model_settings
from lavis_ds.models.vision_llm import VisionLLM
from lavis_ds.models.vision_llm_batch import packed_image_order

COMPOSED = sorted(name for name in models if issubclass(models.get(name), VisionLLM))

SAMPLES = {"instruction": ["<Img><ImageHere></Img> What is in the image?", "Describe the picture in detail.",
                           ["<Img><ImageHere></Img> What color is the ball?", "How many animals are there?"]],
           "output": ["A cat sitting on a mat.", "A dog runs on the grass.", ["It is red.", "Two."]]}


def tiny_section(arch: str, tokenizer, bert_tokenizer, **changes) -> dict:
    cls = registry.get_model_class(arch)
    section = {**cls.default_config("tiny"), "tokenizer": str(tokenizer), **changes}
    connector = section.get("connector")  # blip2_qwen's preset sets its connector by its own keys
    if connector and "qformer_tokenizer" in connectors.get(connector["name"]).__init__.__code__.co_varnames:
        section["connector"] = {**connector, "qformer_tokenizer": str(bert_tokenizer)}
    return section


def batch(model, num_samples: int = 3, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    size = image_side(model)
    return {**{k: v[:num_samples] for k, v in SAMPLES.items()},
            "image": torch.randn(num_samples, 3, size, size, generator=generator)}


def test_every_composed_architecture_is_registered():
    assert {"llava", "instructblip"} <= set(COMPOSED)


@pytest.mark.parametrize("arch", COMPOSED)
def test_tiny_preset_trains_one_step_and_generates(arch, tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    model = registry.get_model_class(arch).from_config(tiny_section(arch, tiny_tokenizer_dir,
                                                                    tiny_bert_tokenizer_dir))
    assert isinstance(model.vision_tower, torch.nn.Module) and isinstance(model.connector, torch.nn.Module)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    samples = batch(model)
    losses = []
    for _ in range(2):
        out = model(samples)
        assert math.isfinite(out["loss"].item()) and out["num_tokens"] > 0
        optimizer.zero_grad()
        out["loss"].backward()
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # the tiny preset trains everything the features depend on: tower, connector, LLM
        assert {n.split(".")[0] for n in trainable} == {"vision_tower", "connector", "llm_model"}
        no_grad = [n for n, p in trainable.items() if p.grad is None and "post_layernorm" not in n]
        assert not no_grad
        optimizer.step()
        losses.append(out["loss"].item())
    assert losses[1] < losses[0]
    answers = model.generate({"image": samples["image"][:2], "instruction": SAMPLES["instruction"][:2]},
                             max_new_tokens=4)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


@pytest.mark.parametrize("arch", COMPOSED)
def test_frozen_tower_and_llm_leave_only_the_connector_training(arch, tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    section = tiny_section(arch, tiny_tokenizer_dir, tiny_bert_tokenizer_dir, freeze_llm=True)
    if "vision_tower" in section:
        section["vision_tower"] = {**section["vision_tower"], "freeze": True}
    else:  # blip2_qwen's key for its tower's `freeze`
        section["freeze_vit"] = True
    model = registry.get_model_class(arch).from_config(section).train()
    model(batch(model))["loss"].backward()
    for name, param in model.named_parameters():
        if name.startswith("connector."):
            # (InstructBLIP's last text feed-forward only feeds text outputs, which are dropped: its gradient is 0)
            assert param.requires_grad and param.grad is not None, name
        else:
            assert not param.requires_grad and param.grad is None, name
    assert all(p.grad.any() for n, p in model.connector.named_parameters() if n.startswith(("llm_proj", "linear_")))
    assert not model.vision_tower.training and not model.llm_model.training  # frozen parts stay in eval


def test_a_mix_no_preset_has_trains(tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    """SigLIP + BLIP-2's Q-Former under arch llava: the parts' sections alone make the model."""
    section = tiny_section("llava", tiny_tokenizer_dir, tiny_bert_tokenizer_dir,
                           vision_tower={"name": "siglip", "preset": "tiny", "freeze": False},
                           connector={"name": "qformer", "num_query_token": 4,
                                      "qformer": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                                  "intermediate_size": 64}})
    model = registry.get_model_class("llava").from_config(section)
    assert model.image_path.layout.tokens_per_image == 4 and model.vision_tower.image_size == 56
    assert model_settings(registry.get_model_class("llava"), section).tokens_per_image() == 4
    out = model(batch(model))
    out["loss"].backward()
    assert math.isfinite(out["loss"].item())
    assert model.connector.query_tokens.grad is not None and model.vision_tower.model.embeddings.patch_embedding.weight.grad is not None
    assert len(model.image_path.blocks()) == 3 + 2  # SigLIP's layers, then the Q-Former's


def test_instruction_rows_follow_the_images_into_packed_order(tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    model = registry.get_model_class("instructblip").from_config(
        tiny_section("instructblip", tiny_tokenizer_dir, tiny_bert_tokenizer_dir)).eval()
    samples = batch(model)
    samples["instruction"] = ["<Img><ImageHere></Img> What is in the image?", "<ImageHere> a dog",
                              "<ImageHere> How many animals are there?"]
    samples["output"] = ["Two.", "A cat sitting on a mat, next to a red ball on the grass.", "It is red."]
    padded = model.prepare_batch(dict(samples))
    lengths = padded["attention_mask"].sum(1).tolist()
    assert lengths[1] > lengths[2]  # rows of the first and last sample's length: the middle one goes last
    packed = model.prepare_batch(dict(samples), pack_to=lengths[0] + lengths[2])
    assert packed["order"] == [0, 2, 1]  # the packer moved samples: the instruction rows must move with them
    with torch.no_grad():
        per_image = model.image_features(padded).unflatten(0, (3, -1))  # flat features: 3 images' rows in turn
        in_packed_order = per_image[packed_image_order(packed)].flatten(0, 1)
        torch.testing.assert_close(model.image_features(packed), in_packed_order, atol=1e-6, rtol=0)
        # each image's own instruction matters: the same images with their instructions swapped differ
        swapped = model.image_features(model.prepare_batch({**samples, "instruction": samples["instruction"][::-1]}))
    assert not torch.allclose(swapped, model.image_features(padded))


def test_image_free_batch_runs_the_blank_image_with_one_instruction(tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    model = registry.get_model_class("instructblip").from_config(
        tiny_section("instructblip", tiny_tokenizer_dir, tiny_bert_tokenizer_dir))
    samples = {"instruction": ["Describe the picture in detail."], "output": ["A cat."], "num_images": [0]}
    prepared = model.prepare_batch(samples)
    assert prepared["qformer_input_ids"].shape[0] == 1
    out = model(prepared)
    out["loss"].backward()
    assert model.connector.query_tokens.grad is not None and not model.connector.query_tokens.grad.any()


# ----------------------------------------------------------------- the config check, before anything is built
def write_run(tmp_path, arch: str, tokenizer, model: dict | None = None, vis_processor: dict | None = None) -> str:
    dataset = {"build_info": {"storage": str(tmp_path / "shapes"), "num_train": 4, "num_val": 2, "num_test": 2}}
    cfg = {"model": {"arch": arch, "model_type": "tiny", "tokenizer": str(tokenizer), **(model or {})},
           "datasets": {"demo_shapes": {**dataset, **({"vis_processor": vis_processor} if vis_processor else {})}},
           "run": {"output_dir": str(tmp_path / "out"), "batch_size_train": 2}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_config_names_a_part_typo_with_the_registered_name(tmp_path, tiny_tokenizer_dir):
    from lavis_ds.config import load_config

    path = write_run(tmp_path, "llava", tiny_tokenizer_dir, {"connector": {"name": "mlp2x_gelo"}})
    with pytest.raises(ConfigError, match=r"model\.connector\.name: Unknown connector 'mlp2x_gelo'\. Did you mean "
                                          r"'mlp2x_gelu'\?"):
        load_config(path)
    path = write_run(tmp_path, "llava", tiny_tokenizer_dir, {"vision_tower": {"vision_feature_layers": -2,
                                                                              "pad_to_square": "yes"}})
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "model.vision_tower.vision_feature_layers: unknown key; did you mean 'vision_feature_layer'?" in str(
        error.value)
    assert "model.vision_tower.pad_to_square: expected bool, got 'yes'" in str(error.value)


def test_config_mix_replaces_the_presets_part_section(tmp_path, tiny_tokenizer_dir):
    """`vision_tower: {name: siglip}` over the CLIP preset: the preset's CLIP keys are not merged into it."""
    from lavis_ds.config import load_config

    path = write_run(tmp_path, "llava", tiny_tokenizer_dir,
                     {"vision_tower": {"name": "siglip", "preset": "tiny", "vision_config": {"image_size": 64,
                                                                                             "patch_size": 16}}})
    cfg = load_config(path)
    assert dict(cfg.model.vision_tower) == {"name": "siglip", "preset": "tiny",
                                            "vision_config": {"image_size": 64, "patch_size": 16}}
    assert dict(cfg.model.connector) == {"name": "mlp2x_gelu"}  # the preset's, untouched
    # the tower fixes the image size: the datasets get it (the tower's own processing, filled in) ...
    path = write_run(tmp_path, "llava", tiny_tokenizer_dir, {"vision_tower": {"name": "siglip", "preset": "tiny"}})
    assert load_config(path).datasets.demo_shapes.vis_processor.train.image_size == 56
    # ... and a processor the YAML names must make it
    path = write_run(tmp_path, "llava", tiny_tokenizer_dir, {"vision_tower": {"name": "siglip", "preset": "tiny"}},
                     {"train": {"name": "tower_image_train", "image_size": 64}})
    with pytest.raises(ConfigError, match=r"vis_processor\.train\.image_size: 64 but the model's vision tower takes "
                                          r"56 px images only"):
        load_config(path)


def test_config_reports_what_building_the_parts_would_refuse(tmp_path, tiny_tokenizer_dir):
    from lavis_ds.config import load_config

    path = write_run(tmp_path, "llava", tiny_tokenizer_dir, {"vision_tower": {"vision_feature_layer": 7}})
    with pytest.raises(ConfigError, match=r"vision_tower\.vision_feature_layer: 7; valid: an int or a non-empty list"):
        load_config(path)
    path = write_run(tmp_path, "instructblip", tiny_tokenizer_dir,
                     {"connector": {"qformer_tokenizer": str(tmp_path / "nowhere")}})
    with pytest.raises(ConfigError, match=r"model\.connector\.qformer_tokenizer: .*nowhere' does not exist"):
        load_config(path)


def test_users_connector_under_imports_trains_in_a_tiny_llava(tmp_path, tiny_tokenizer_dir):
    """docs/models.md's example: tests/user_connector.py registers avgpool2x2_mlp; a run names it under
    `imports:` and as model.connector; the config check accepts it and the built model learns."""
    from lavis_ds.build import build_model
    from lavis_ds.config import load_config

    path = write_run(tmp_path, "llava", tiny_tokenizer_dir, {"connector": {"name": "avgpool2x2_mlp", "hidden": 32}})
    cfg = yaml.safe_load((tmp_path / "run.yaml").read_text())
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"imports": ["user_connector"], **cfg}))
    model = build_model(load_config(path, check_files=False).model)
    # 16 patches pooled 2x2
    assert type(model.connector).__name__ == "AvgPoolMlp" and model.image_path.layout.tokens_per_image == 4
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    samples = batch(model)
    losses = []
    for _ in range(5):
        loss = model(samples)["loss"]
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.connector.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_llava_lora_recipes_lr_scales_put_the_connector_at_a_tenth(tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    """projects/llava/stage2_finetune_lora.yaml's run.lr_scales on a tiny llava with the recipe's LoRA switches:
    the connector at 0.1 x the adapters' lr (2e-5 against 2e-4), nothing else scaled."""
    from lavis_ds.config import load_config
    from lavis_ds.optim.param_groups import build_param_groups
    from run_utils import REPO

    recipe = load_config(REPO / "projects/llava/stage2_finetune_lora.yaml", world_size=4, check_files=False)
    switches = {k: recipe.model[k] for k in ("freeze_llm", "get_lora", "lora_target_modules")}
    model = registry.get_model_class("llava").from_config(
        tiny_section("llava", tiny_tokenizer_dir, tiny_bert_tokenizer_dir, **switches, vision_tower={
            **registry.get_model_class("llava").default_config("tiny")["vision_tower"], "freeze": True}))
    groups = build_param_groups(model, 0.0, dict(recipe.run.lr_scales))
    scaled = {id(p) for g in groups if g["lr_scale"] == 0.1 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in scaled}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert recipe.run.init_lr * 0.1 == pytest.approx(2e-5)
    assert names == {n for n in trainable if n.startswith("connector.")} and names
    assert all("lora_" in n for n in trainable - names)
