"""Published checkpoints into the composed architectures, against the transformers classes that wrote them.

Tiny random models saved in the real format (``save_pretrained``): lavis_ds's logits of the same inputs (pixel
values, expanded input_ids) agree with transformers' within 1e-5 (fp32), and greedy generation gives the same
answers, batched with left padding. LAVIS's InstructBLIP ``.pth`` and LLaVA's ``mm_projector.bin`` load the same
parts; a folder whose parts do not fit the configured ones is one line naming the folder and what differs. The
``model:`` section docs/models.md shows (preset, ``load_pretrained``, ``pretrained``) passes the config check and loads
llava-1.5-style and Llama-3 InstructBLIP folders, also under the frozen-LLM presets.
"""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoTokenizer, CLIPVisionConfig, InstructBlipConfig, InstructBlipForConditionalGeneration,
                          LlavaConfig, LlavaForConditionalGeneration, Qwen2Config)

import lavis_ds  # noqa: F401  (fills the registries)
from lavis_ds.models import InstructBlip, Llava
from lavis_ds.models.parts import PartError
from lavis_ds.models.prompt import pad_batch

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, tie_word_embeddings=False)
CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=64,
            patch_size=16, hidden_act="quick_gelu")
EVA = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, image_size=64,
           patch_size=16)
QFORMER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1000,
               encoder_hidden_size=64)
INSTRUCTIONS = ["<Img><ImageHere></Img> What is in the image?", "<ImageHere> Describe the picture in detail."]


def llm_tokenizer(tokenizer_dir):
    """The tiny ChatML tokenizer with LLaVA's `<image>` token, as a published folder's tokenizer has it."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    return tokenizer, tokenizer.convert_tokens_to_ids("<image>")


def randomised(model):
    with torch.no_grad():  # random, not the init's zeros/ones: every weight must land where it belongs
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory, tiny_tokenizer_dir):
    folder = tmp_path_factory.mktemp("published") / "llava"
    tokenizer, image_id = llm_tokenizer(tiny_tokenizer_dir)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**CLIP), text_config=Qwen2Config(**TEXT, vocab_size=len(
        tokenizer)), image_token_index=image_id, image_seq_length=16, vision_feature_layer=-2)
    torch.manual_seed(0)
    randomised(LlavaForConditionalGeneration(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def instructblip_folder(tmp_path_factory, tiny_tokenizer_dir, tiny_bert_tokenizer_dir):
    folder = tmp_path_factory.mktemp("published") / "instructblip"
    tokenizer, image_id = llm_tokenizer(tiny_tokenizer_dir)
    config = InstructBlipConfig(vision_config=EVA, qformer_config=QFORMER, num_query_tokens=8,
                                text_config=Qwen2Config(**TEXT, vocab_size=len(tokenizer)).to_dict())
    config.image_token_id = image_id
    torch.manual_seed(0)
    randomised(InstructBlipForConditionalGeneration(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_bert_tokenizer_dir).save_pretrained(folder / "qformer_tokenizer")
    return folder


def ours(cls, folder, **changes):
    section = {**cls.default_config("tiny"), "tokenizer": None, "load_pretrained": True, "pretrained": str(folder),
               **changes}
    return cls.from_config(section).eval()


def prompts(model, count: int):
    """Left-padded generation prompts, as lavis_ds's generate makes them."""
    ids = [model.llm.prompt.generation_prompt(ins, (), 1) for ins in INSTRUCTIONS[:count]]
    return pad_batch(ids, model.llm.pad_id, side="left")


def check_logits_and_generation(model, reference, extra_inputs, generation: bool = True):
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, 64, 64)
    input_ids, attention_mask = prompts(model, 2)
    samples = {"image": pixels, "instruction": INSTRUCTIONS}
    with torch.no_grad():
        features = model.image_path.features(pixels, dummy=False, samples=samples)
        logits = model.llm_model(inputs_embeds=model.image_path.embed(input_ids, features),
                                 attention_mask=attention_mask).logits
        theirs = reference(pixel_values=pixels, input_ids=input_ids, attention_mask=attention_mask,
                           **extra_inputs(model, samples)).logits
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], theirs[real], atol=1e-5, rtol=0)
    if not generation:
        return

    answers = model.generate(samples, max_new_tokens=8)
    with torch.no_grad():
        generated = reference.generate(pixel_values=pixels, input_ids=input_ids, attention_mask=attention_mask,
                                       max_new_tokens=8, do_sample=False, eos_token_id=model.llm.stop_token_ids(),
                                       pad_token_id=model.llm.pad_id, suppress_tokens=[model.llm.prompt.image_token_id],
                                       **extra_inputs(model, samples))
    new = generated[:, input_ids.shape[1]:]
    assert (new != model.llm.pad_id).sum(1).min() > 2  # a real answer, not an immediate stop
    assert answers == [t.strip() for t in model.llm.tokenizer.batch_decode(new, skip_special_tokens=True)]


def test_llava_folder_gives_transformers_logits_and_answers(llava_folder):
    model = ours(Llava, llava_folder)
    assert model.llm.prompt.image_token == "<image>" and model.image_path.layout.tokens_per_image == 16
    reference = LlavaForConditionalGeneration.from_pretrained(llava_folder).eval()
    check_logits_and_generation(model, reference, lambda model, samples: {})


def test_llava_folder_in_the_older_layout_under_lora_gives_the_same(llava_folder, tmp_path):
    """transformers 4.52-4.x wrote `model.vision_tower.vision_model.*`, `model.language_model.*`, `lm_head.*`; LoRA
    wraps the LLM's linear layers (`base_layer`) before the folder is loaded, and starts as the identity."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    older = tmp_path / "llava_older"
    shutil.copytree(llava_folder, older)
    renames = ((r"^vision_tower\.", "model.vision_tower.vision_model."),
               (r"^multi_modal_projector\.", "model.multi_modal_projector."),
               (r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."))
    state = load_file(llava_folder / "model.safetensors")
    for pattern, replacement in renames:
        state = {re.sub(pattern, replacement, k): v for k, v in state.items()}
    assert any(k.startswith("model.language_model.") for k in state)
    save_file(state, older / "model.safetensors", metadata={"format": "pt"})
    model = ours(Llava, older, freeze_llm=True, get_lora=True, lora_r=4, lora_alpha=8)
    assert any(".lora_A." in n for n, _ in model.named_parameters())
    reference = LlavaForConditionalGeneration.from_pretrained(llava_folder).eval()
    check_logits_and_generation(model, reference, lambda model, samples: {})


def test_instructblip_folder_gives_transformers_logits_and_answers(instructblip_folder):
    model = ours(InstructBlip, instructblip_folder)
    assert model.connector.tokenizer.name_or_path.endswith("qformer_tokenizer")
    reference = InstructBlipForConditionalGeneration.from_pretrained(instructblip_folder).eval()
    check_logits_and_generation(model, reference, lambda model, samples: model.image_path.host_inputs(samples))


def test_lavis_instructblip_pth_loads_the_folders_parts(instructblip_folder, tmp_path):
    from test_towers_connectors import lavis_instruct_state

    from_folder = ours(InstructBlip, instructblip_folder)
    lavis = lavis_instruct_state(InstructBlipForConditionalGeneration.from_pretrained(instructblip_folder).state_dict())
    lavis["model"].update({f"visual_encoder.{k}": v for k, v in from_folder.vision_tower.vit.state_dict().items()})
    torch.save(lavis, tmp_path / "instruct_blip_vicuna7b_trimmed.pth")
    from_pth = ours(InstructBlip, tmp_path / "instruct_blip_vicuna7b_trimmed.pth", tokenizer=str(instructblip_folder),
                    connector={**InstructBlip.default_config("tiny")["connector"], "ln_vision_eps": 1e-6,
                               "qformer_tokenizer": str(instructblip_folder / "qformer_tokenizer")})
    for part in ("vision_tower", "connector"):
        a, b = getattr(from_folder, part).state_dict(), getattr(from_pth, part).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


def test_llava_stage1_mm_projector_bin_loads_the_connector(llava_folder, tmp_path, tiny_tokenizer_dir):
    projector = LlavaForConditionalGeneration.from_pretrained(llava_folder).model.multi_modal_projector.state_dict()
    torch.save({f"model.mm_projector.{i}.{kind}": projector[f"linear_{j}.{kind}"]
                for i, j in ((0, 1), (2, 2)) for kind in ("weight", "bias")}, tmp_path / "mm_projector.bin")
    model = ours(Llava, tmp_path / "mm_projector.bin", tokenizer=str(tiny_tokenizer_dir),
                 llm_config={**TEXT})
    assert all(torch.equal(model.connector.state_dict()[k], v) for k, v in projector.items())


def test_a_folder_whose_parts_do_not_fit_names_what_differs(llava_folder, instructblip_folder):
    tower = {**Llava.default_config("tiny")["vision_tower"], "vision_feature_layer": -1}
    with pytest.raises(PartError, match=r"model\.pretrained: .*llava \(LlavaForConditionalGeneration\) does not fit "
                                        r"the configured model: vision_feature_layer/select_strategy: folder "
                                        r"-2/default, model -1/default"):
        ours(Llava, llava_folder, vision_tower=tower)
    with pytest.raises(PartError, match=r"instructblip \(InstructBlipForConditionalGeneration\) does not fit the "
                                        r"configured model: .*Q-Former num_query_tokens: folder 8, model 4"):
        connector = {**InstructBlip.default_config("tiny")["connector"], "num_query_token": 4}
        ours(InstructBlip, instructblip_folder, connector=connector)
    with pytest.raises(PartError, match=r"does not fit the configured model: connector: the folder's is instruct_qformer, "
                                        r"the model's mlp2x_gelu; vision tower: the folder's is eva_vit_g, the model's "
                                        r"clip"):
        ours(Llava, instructblip_folder)
    tower = {**Llava.default_config("tiny")["vision_tower"], "name": "siglip"}
    with pytest.raises(PartError, match=r"vision tower: the folder's is clip_vision_model, the model's siglip"):
        ours(Llava, llava_folder, vision_tower=tower)


# ----------------------------------------------------------------- folders as users have them, the YAML as documented
def llama2_style_tokenizer(folder):
    """A tokenizer shaped like Vicuna's in llava-1.5 folders: ``<unk>``, ``<s>``, ``</s>``, no chat template, no ChatML
    tokens, and ``<image>`` / ``<pad>`` added as llava-hf adds them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import TINY_CORPUS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(TINY_CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    assert tokenizer.chat_template is None and "<|im_start|>" not in tokenizer.get_vocab()
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture(scope="module")
def llava15_folder(tmp_path_factory):
    """llava-1.5 as llava-hf publishes it, at a toy size: CLIP + a Llama LLM, a tokenizer without a chat template."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("published") / "llava-1.5"
    tokenizer = llama2_style_tokenizer(folder)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**CLIP), text_config=LlamaConfig(**TEXT, vocab_size=len(
        tokenizer)), image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=16,
        vision_feature_layer=-2)
    torch.manual_seed(0)
    randomised(LlavaForConditionalGeneration(config)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def instructblip_llama3_folder(tmp_path_factory, tiny_bert_tokenizer_dir):
    """An InstructBLIP folder whose LLM is a Llama 3 with its chat template (``<|eot_id|>`` turns)."""
    from transformers import LlamaConfig

    from families import LLAMA_MODEL, tokenizer_dir

    folder = tokenizer_dir(tmp_path_factory.mktemp("published") / "instructblip-llama3", "llama3.3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = InstructBlipConfig(vision_config=EVA, qformer_config=QFORMER, num_query_tokens=8,
                                text_config=LlamaConfig(**TEXT, vocab_size=len(tokenizer)).to_dict())
    config.image_token_id = tokenizer.convert_tokens_to_ids(LLAMA_MODEL["image_token"])
    torch.manual_seed(0)
    randomised(InstructBlipForConditionalGeneration(config)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_bert_tokenizer_dir).save_pretrained(folder / "qformer_tokenizer")
    return folder


# The model: section of docs/models.md ("Starting from a published folder"): the preset and the folder, nothing else.
# Under the full-size presets the tiny folders' parts need the tiny sizes, which a user with the real folder leaves out.
AS_DOCUMENTED = {"llava": {}, "instructblip": {}}
TINY_PARTS = {"llava": {"vision_tower": {"preset": "tiny", "vision_config": {"image_size": 64, "patch_size": 16}}},
              "instructblip": {"vision_tower": {"preset": "tiny", "image_size": 64, "precision": "fp32"},
                               "connector": {"num_query_token": 8, "qformer": QFORMER}}}
FROZEN_LLM_PRESET = {"llava": "llava1.5_7b", "instructblip": "vicuna7b"}


def run_yaml(tmp_path, arch: str, model_type: str, folder, extra: dict) -> str:
    import yaml

    model = {"arch": arch, "model_type": model_type, "load_pretrained": True, "pretrained": str(folder), **extra}
    cfg = {"model": model, "datasets": {"demo_shapes": {"build_info": {"storage": str(tmp_path / "shapes")}}},
           "run": {"output_dir": str(tmp_path / "out"), "batch_size_train": 2}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "run.yaml")


def with_added_rows(reference, model):
    """transformers' model given the embedding and output rows of the tokens lavis_ds added to the folder's tokenizer
    (ChatML's, for a tokenizer without a chat template): the mean of the folder's rows, as docs/models.md says."""
    from lavis_ds.models.llm import base_llm

    old = reference.get_input_embeddings().num_embeddings
    new = base_llm(model.llm_model).get_input_embeddings().num_embeddings
    if new > old:
        reference.resize_token_embeddings(new, mean_resizing=False)
        with torch.no_grad():
            for matrix in (reference.get_input_embeddings().weight, reference.get_output_embeddings().weight):
                matrix[old:] = matrix[:old].mean(dim=0, keepdim=True)
    return reference


@pytest.mark.parametrize("arch, preset", [("llava", "tiny"), ("llava", "frozen"), ("instructblip", "tiny"),
                                          ("instructblip", "frozen")])
def test_the_documented_yaml_loads_a_published_folder_through_the_config_check(
        arch, preset, llava15_folder, instructblip_llama3_folder, tmp_path):
    """(a) The config check completes the section with what the folder brings (tokenizer, LLM) as the build does.
    (b) Under a frozen-LLM preset the ChatML tokens a tokenizer lacks get trainable rows, which the folder's LLM loads
    under. Both: transformers' logits; the frozen presets (the rows' path) also its greedy answers."""
    from lavis_ds.build import build_model
    from lavis_ds.config import load_config

    folder = {"llava": llava15_folder, "instructblip": instructblip_llama3_folder}[arch]
    model_type = "tiny" if preset == "tiny" else FROZEN_LLM_PRESET[arch]
    cfg = load_config(run_yaml(tmp_path, arch, model_type, folder,
                               AS_DOCUMENTED[arch] if preset == "tiny" else TINY_PARTS[arch]))
    model = build_model(cfg.model).eval()
    assert model.llm.tokenizer.name_or_path == str(folder)
    trains = sorted(n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("connector."))
    # A Llama tokenizer without a chat template gets ChatML's tokens; a frozen LLM trains their rows only.
    chatml_rows = ["llm_model.lm_head.rows", "llm_model.model.embed_tokens.rows"]
    if preset == "tiny":
        assert "llm_model.model.embed_tokens.weight" in trains
    else:
        assert trains == (chatml_rows if arch == "llava" else [])
    if arch == "llava":
        assert model.llm.prompt.image_token == "<image>" and model.llm.prompt.end_of_turn_id > 300  # <|im_end|>, added
        reference = with_added_rows(LlavaForConditionalGeneration.from_pretrained(folder).eval(), model)
        check_logits_and_generation(model, reference, lambda model, samples: {}, generation=preset == "frozen")
    else:
        assert model.llm.prompt.end_of_turn_id == model.llm.tokenizer.convert_tokens_to_ids("<|eot_id|>")
        reference = InstructBlipForConditionalGeneration.from_pretrained(folder).eval()
        check_logits_and_generation(model, reference, lambda model, samples: model.image_path.host_inputs(samples),
                                    generation=preset == "frozen")
