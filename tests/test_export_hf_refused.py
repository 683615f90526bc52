"""--format hf: what no transformers class holds is refused, with why and what to do instead; the image processors
written for LLaVA give the tower's pixels (tests/test_export_hf_arch.py checks what is exported)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lavis_ds.apps.export_hf import write_hf_folder
from lavis_ds.apps.export_hf_checks import check_expressible
from lavis_ds.apps.export_io import ExportError
from lavis_ds.common.registry import hf_families
from lavis_ds.models import Llava  # importing lavis_ds.models registers the families too


# ----------------------------------------------------------------------------- the pixels
@pytest.mark.parametrize("resize, pad", [("shortest_edge", False), ("squash", False), ("shortest_edge", True),
                                         ("squash", True)])
def test_the_llava_image_processors_give_the_tower_s_pixels(resize, pad):
    from lavis_ds.apps.export_hf_processor import image_processor
    from lavis_ds.models.towers.base import ImageProcessing

    processing = ImageProcessing(56, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), resize, pad)
    theirs, ours = image_processor(processing, "llava"), processing.transform()
    rng = np.random.default_rng(0)
    # (59, 56): CLIP's crop of a long side 3 px over the size (below).
    sizes = [(80, 100), (56, 56), (31, 57), (200, 120), (61, 56), (57, 56)] + ([] if resize == "shortest_edge"
                                                                             and not pad else [(59, 56)])
    for height, width in sizes:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        pixels = torch.as_tensor(np.asarray(theirs(image, return_tensors="pt").pixel_values[0]))
        assert torch.equal(pixels, ours(image)), (height, width)


def test_clip_s_centre_crop_is_one_pixel_off_where_torchvision_rounds_half_to_even():
    """torchvision's CenterCrop starts at round((long - size) / 2), transformers' at (long - size) // 2: for a
    difference of 3 mod 4 px they are one pixel apart (docs/export-hf.md says so)."""
    from lavis_ds.apps.export_hf_processor import image_processor
    from lavis_ds.models.towers.base import ImageProcessing

    processing = ImageProcessing(56, resize="shortest_edge")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (59, 56, 3), dtype=np.uint8))
    theirs = torch.as_tensor(np.asarray(image_processor(processing, "llava")(image).pixel_values[0]))
    ours = processing.transform()(image)
    assert not torch.equal(theirs, ours)
    assert torch.equal(theirs[:, :-1], ours[:, 1:]) or torch.equal(theirs[:, 1:], ours[:, :-1])


# ----------------------------------------------------------------------------- what is refused
def _pair(tokenizer_dir, bert_dir, tower: dict, connector: dict) -> Llava:
    cfg = Llava.default_config("tiny")
    cfg.update(tokenizer=str(tokenizer_dir), vision_tower=tower, connector=connector)
    return Llava.from_config(cfg)


TINY_EVA = {"name": "eva_vit_g", "preset": "tiny", "image_size": 64, "precision": "fp32"}
TINY_CLIP = {"name": "clip", "preset": "tiny", "vision_config": {"image_size": 64, "patch_size": 16}}
TINY_SIGLIP = {"name": "siglip", "preset": "tiny", "vision_config": {"image_size": 56, "patch_size": 14}}
TINY_QFORMER = {"num_query_token": 4, "qformer": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                                  "intermediate_size": 64, "vocab_size": 1000}}


@pytest.mark.parametrize("tower, connector, why", [
    (TINY_SIGLIP, {"name": "qformer", **TINY_QFORMER}, "no transformers class holds this tower with this connector"),
    (TINY_CLIP, {"name": "instruct_qformer", **TINY_QFORMER}, "no transformers class holds this tower with this connector"),
    (TINY_EVA, {"name": "mlp2x_gelu"}, "no transformers class holds this tower with this connector"),
    (TINY_SIGLIP, {"name": "linear"}, r"LlavaConfig's projector is always linear_1 -> projector_hidden_act -> "
                                      r"linear_2, two layers: a single linear connector has no place in it"),
], ids=["siglip+qformer", "clip+instruct_qformer", "eva+mlp2x_gelu", "siglip+linear"])
def test_a_pair_no_transformers_class_holds_is_refused_with_what_to_do_instead(
        tower, connector, why, tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    if connector["name"] == "instruct_qformer":
        connector = {**connector, "qformer_tokenizer": str(tiny_bert_tokenizer_dir)}
    model = _pair(tiny_tokenizer_dir, tiny_bert_tokenizer_dir, tower, connector)
    with pytest.raises(ExportError, match=rf"^--format hf: cannot export vision tower '{tower['name']}' \+ connector "
                                          rf"'{connector['name']}': {why}\. What --format hf writes: .*"
                                          r"LlavaForConditionalGeneration: a clip or siglip tower \+ mlp2x_gelu.* "
                                          r"For this model, export it with --format lavis_ds \(the default\)"):
        check_expressible(model)


def test_an_eva_qformer_pair_exports_as_blip2(tiny_tokenizer_dir, tiny_bert_tokenizer_dir, tmp_path):
    from transformers import Blip2ForConditionalGeneration

    model = _pair(tiny_tokenizer_dir, tiny_bert_tokenizer_dir, TINY_EVA,
                  {"name": "qformer", **TINY_QFORMER, "ln_vision_eps": 1e-6}).eval()
    assert write_hf_folder(model, tmp_path) == []
    hf = Blip2ForConditionalGeneration.from_pretrained(tmp_path)
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(hf.get_image_features(images).pooler_output, model.image_path.encode(images, {}))


def test_what_llava_cannot_express_is_refused(tiny_tokenizer_dir):
    from transformers import Qwen2ForCausalLM

    class PatchedQwen2(Qwen2ForCausalLM):
        pass

    model = _pair(tiny_tokenizer_dir, None, TINY_CLIP, {"name": "mlp2x_gelu"})
    model.llm_model.__class__ = PatchedQwen2
    model.connector.linear_2.bias = None
    with pytest.raises(ExportError) as refused:
        check_expressible(model, {"name": "my_resize_crop", "image_size": 64})
    lines = str(refused.value).splitlines()
    assert lines[0] == "cannot export as transformers' LlavaForConditionalGeneration, which cannot express:"
    assert lines[1].startswith("  - connector: one linear layer with a bias and one without")
    assert lines[2].startswith("  - llm_model: PatchedQwen2, but text_config model_type 'qwen2' builds "
                               "Qwen2ForCausalLM")
    assert lines[3].startswith("  - the eval image processor 'my_resize_crop'") and len(lines) == 4


# ----------------------------------------------------------------------------- the families, as registered
@pytest.mark.parametrize("name", list(hf_families))
def test_every_registered_family_names_a_transformers_class_and_registered_parts(name):
    """Tests follow the registry: every family's class and config model_type are transformers', it holds its
    three parts, its pairs are registered parts, and the refusal message lists what it exports."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from lavis_ds.apps.export_hf_checks import exportable
    from lavis_ds.common.registry import connectors, vision_towers
    from lavis_ds.models.hf.family_parts import FolderReading, ProcessorExport, WeightsExport

    family = hf_families.get(name)
    assert hasattr(transformers, family.hf_class) and family.model_type in CONFIG_MAPPING_NAMES
    # it holds one part per job, each of this record
    parts = {WeightsExport: family.weights, ProcessorExport: family.processors, FolderReading: family.folders}
    assert all(isinstance(part, interface) and part.family is family for interface, part in parts.items())
    assert family.pairs and all(tower in vision_towers and connector in connectors for tower, connector in family.pairs)
    assert family.exports() in exportable()
    with pytest.raises(KeyError, match=rf"Hugging Face family name '{name}' is already registered by "
                                       rf"lavis_ds\.models\.hf\.\w+\.{type(family).__name__}"):
        hf_families.register(name)(type(family)())
