"""The LLM side on real files: a tiny Qwen2 folder saved with save_pretrained, its tokenizer, LoRA, export merge.

Unit tests build in-process; the end-to-end tests run `torchrun --nproc_per_node=2 train.py`
on that folder through a YAML (LLM frozen; LoRA under ZeRO 0-3) and read back what the
checkpoints hold.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from conftest import TINY_CORPUS
from lavis_ds.build import build_model
from lavis_ds.config import load_config
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from lavis_ds.models import Blip2Qwen
from lavis_ds.models.llm import TokenRowsEmbedding, TokenRowsHead, lora_target_names
from lavis_ds.models.tokenizer import train_chatml_tokenizer
from run_utils import run_train, tiny_config, train_steps, write_yaml

QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2: no <|image_pad|>
PLAIN_SPECIALS = ("<|endoftext|>",)  # a non-chat tokenizer: no ChatML tokens either
SPARE_ROWS = 16  # real Qwen2.5 embeddings have ~270 rows more than the tokenizer has tokens
TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024)
SAMPLES = {"instruction": [["<Img><ImageHere></Img> What is in the image?"],
                           ["Describe the picture in detail.", "What color is the ball?"]],
           "output": [["A cat sitting on a mat."], ["A dog runs on the grass.", "It is red."]]}


def samples() -> dict:
    return {"image": torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)), **SAMPLES}


def qwen_folder(path: Path, specials=None, spare_rows: int = SPARE_ROWS, tie: bool = False) -> Path:
    """A tiny Qwen2 folder as transformers writes it: model (save_pretrained) and tokenizer."""
    kwargs = {} if specials is None else {"special_tokens": specials}
    train_chatml_tokenizer(TINY_CORPUS, path, vocab_size=400, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    llm = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer) + spare_rows, tie_word_embeddings=tie, **TINY_QWEN2))
    llm.save_pretrained(path)
    return path


def build(llm_dir: Path, **overrides) -> Blip2Qwen:
    """The `tiny` preset on the LLM folder: LLM, ViT, Q-Former and queries frozen, the projection trains."""
    cfg = {**Blip2Qwen.default_config("tiny"), "llm_model": str(llm_dir), "tokenizer": None, "freeze_vit": True,
           "freeze_qformer": True, "freeze_queries": True, "freeze_llm": True, **overrides}
    torch.manual_seed(0)
    return Blip2Qwen.from_config(cfg)


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def llm_weights(path: Path) -> dict[str, torch.Tensor]:
    return Qwen2ForCausalLM.from_pretrained(path).state_dict()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    return {"qwen25": qwen_folder(root / "qwen25"),
            "qwen25_tied": qwen_folder(root / "qwen25_tied", tie=True),  # as Qwen2.5-0.5B/1.5B/3B
            "qwen2": qwen_folder(root / "qwen2", QWEN2_SPECIALS),
            "qwen2_no_spare": qwen_folder(root / "qwen2_no_spare", QWEN2_SPECIALS, spare_rows=0),
            "plain": qwen_folder(root / "plain", PLAIN_SPECIALS, spare_rows=0),
            "plain_tied": qwen_folder(root / "plain_tied", PLAIN_SPECIALS, spare_rows=0, tie=True)}


# ----------------------------------------------------------------- tokens and embedding rows
def test_qwen25_tokenizer_adds_nothing_and_the_folder_weights_load_unchanged(folders):
    model = build(folders["qwen25"])
    folder_tokenizer = AutoTokenizer.from_pretrained(folders["qwen25"])
    assert model.llm.tokenizer.get_vocab() == folder_tokenizer.get_vocab()
    assert model.llm_model.get_input_embeddings().num_embeddings == len(folder_tokenizer) + SPARE_ROWS
    state = model.llm_model.state_dict()
    for name, tensor in llm_weights(folders["qwen25"]).items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    assert trainable(model) == {"connector.llm_proj.weight", "connector.llm_proj.bias"}


def test_qwen2_tokenizer_gets_the_image_token_in_a_spare_row_without_resize(folders):
    model = build(folders["qwen2"])
    size = len(AutoTokenizer.from_pretrained(folders["qwen2"]))
    assert model.llm.prompt.image_token_id == size  # the next id: a spare row of the embedding
    assert model.llm_model.get_input_embeddings().num_embeddings == size + SPARE_ROWS  # not resized
    # The placeholder's row never trains: image features replace it, it is never a target.
    assert trainable(model) == {"connector.llm_proj.weight", "connector.llm_proj.bias"}
    assert torch.isfinite(model(samples())["loss"])


def test_missing_row_resizes_once_with_deterministic_mean_rows(folders):
    model = build(folders["qwen2_no_spare"])
    size = len(AutoTokenizer.from_pretrained(folders["qwen2_no_spare"]))
    original = llm_weights(folders["qwen2_no_spare"])
    for module, name in ((model.llm_model.get_input_embeddings(), "model.embed_tokens.weight"),
                         (model.llm_model.get_output_embeddings(), "lm_head.weight")):
        assert module.weight.shape[0] == size + 1
        torch.testing.assert_close(module.weight[:size], original[name], rtol=0, atol=0)
        torch.testing.assert_close(module.weight[size], original[name].mean(0))
    assert model.llm_model.config.vocab_size == size + 1
    # Rebuilt from the same YAML (resume, export): the same rows.
    again = build(folders["qwen2_no_spare"])
    torch.testing.assert_close(again.llm_model.get_output_embeddings().weight,
                               model.llm_model.get_output_embeddings().weight, rtol=0, atol=0)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tokenizer_without_chatml_trains_only_the_new_rows(folders, tie):
    model = build(folders["plain_tied" if tie else "plain"])
    tokenizer, size = model.llm.tokenizer, len(AutoTokenizer.from_pretrained(folders["plain"]))
    new_ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|image_pad|>"])
    assert new_ids == [size, size + 1, size + 2]
    embedding, head = model.llm_model.get_input_embeddings(), model.llm_model.get_output_embeddings()
    assert isinstance(embedding, TokenRowsEmbedding) and isinstance(head, TokenRowsHead)
    assert embedding.token_ids.tolist() == new_ids[:2]  # ChatML only; the image row never trains
    assert embedding.num_embeddings == size + 3
    rows = {"llm_model.model.embed_tokens.rows"} | (set() if tie else {"llm_model.lm_head.rows"})
    assert trainable(model) == {"connector.llm_proj.weight", "connector.llm_proj.bias"} | rows
    assert (head.rows is embedding.rows) is tie

    model.train()
    model(samples())["loss"].backward()
    for name in rows:
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.shape == (2, 64) and grad.abs().sum() > 0, name
    # Every other row is the frozen base: no gradient reaches it.
    assert embedding.base.weight.grad is None and head.base.weight.grad is None


def test_token_rows_are_used_for_input_and_output(folders):
    model = build(folders["plain"]).eval()
    embedding, head = model.llm_model.get_input_embeddings(), model.llm_model.get_output_embeddings()
    with torch.no_grad():
        embedding.rows.copy_(torch.randn_like(embedding.rows))
        head.rows.copy_(torch.randn_like(head.rows))
        ids = torch.tensor([[5, embedding.token_ids[0].item(), 7, embedding.token_ids[1].item()]])
        out = embedding(ids)
        torch.testing.assert_close(out[0, [1, 3]], embedding.rows)
        torch.testing.assert_close(out[0, [0, 2]], embedding.base.weight[[5, 7]])
        hidden = torch.randn(1, 3, 64)
        logits = head(hidden)
        torch.testing.assert_close(logits[..., head.token_ids], hidden @ head.rows.T)
        other = torch.ones(logits.shape[-1], dtype=torch.bool)
        other[head.token_ids] = False
        torch.testing.assert_close(logits[..., other], (hidden @ head.base.weight.T)[..., other])


def test_pad_eos_and_the_saved_tokenizer(folders, tmp_path):
    model = build(folders["plain"])
    tokenizer = model.llm.tokenizer
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.llm.pad_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == "<|endoftext|>"  # a non-chat tokenizer's; generation also stops at <|im_end|>
    model.save_run_files(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert saved.get_vocab() == tokenizer.get_vocab()
    text = "<|im_start|>user\n<|image_pad|><|image_pad|> hi<|im_end|>"
    assert saved(text)["input_ids"] == tokenizer(text)["input_ids"]
    # Built on the saved tokenizer, nothing more is added: export and inference see the same ids.
    again = build(folders["plain"], tokenizer=str(tmp_path / "tokenizer"))
    assert again.llm.tokenizer.get_vocab() == tokenizer.get_vocab()
    rows = model.llm_model.get_input_embeddings().num_embeddings
    assert again.llm_model.get_input_embeddings().num_embeddings == rows


def test_image_token_used_as_pad_is_refused(folders):
    with pytest.raises(ValueError, match=r"pads with the image token '<\|endoftext\|>'; set model.image_token"):
        build(folders["qwen25"], image_token="<|endoftext|>")


def test_generation_never_emits_the_placeholder_and_stops_at_im_end(folders):
    model = build(folders["qwen25"]).eval()
    with torch.no_grad():
        # Make the placeholder the most likely token everywhere: generation must still not emit it.
        model.llm_model.lm_head.weight[model.llm.prompt.image_token_id] = 100 * model.llm_model.lm_head.weight.mean(0)
        model.llm_model.lm_head.weight[model.llm.prompt.image_token_id] += 10.0
    recorded = []
    hf_generate = model.llm_model.generate
    model.llm_model.generate = lambda **kw: recorded.append(kw) or hf_generate(**kw)
    texts = model.generate(samples(), max_new_tokens=5)
    assert len(texts) == 2 and "<|image_pad|>" not in "".join(texts)
    assert recorded[0]["eos_token_id"] == [model.llm.end_of_turn_id]  # Qwen2.5-Instruct style: eos is <|im_end|>
    new = hf_generate(**recorded[0])
    assert (new != model.llm.prompt.image_token_id).all()


# ----------------------------------------------------------------- LoRA
def test_lora_targets_are_checked_against_the_llm_modules(folders):
    assert lora_target_names(Qwen2ForCausalLM(Qwen2Config(vocab_size=32, **TINY_QWEN2))) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with pytest.raises(ValueError, match=r"model\.lora_target_modules: 'q_prj' \(did you mean 'q_proj'\?\), "
                                         r"'c_attn' is not a linear layer of the LLM \(Qwen2ForCausalLM\); "
                                         r"valid names: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        build(folders["qwen25"], get_lora=True, lora_target_modules=["q_prj", "v_proj", "c_attn"])
    with pytest.raises(ValueError, match="lora_target_modules is empty; valid names: down_proj"):
        build(folders["qwen25"], get_lora=True, lora_target_modules=[])
    model = build(folders["qwen25"], get_lora=True, lora_target_modules=["self_attn.q_proj", "mlp.down_proj"])
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[1] for n in trainable(model) if ".lora_A" in n}
    assert adapted == {"q_proj", "down_proj"}


def _perturb(model: Blip2Qwen) -> None:
    """LoRA's B starts at zero and token rows as copies: make both matter before comparing."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name or name.endswith(".rows"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))


@pytest.mark.parametrize("folder, lora", [("qwen25", True), ("plain", False), ("plain_tied", True)],
                         ids=["lora", "token_rows", "lora_and_tied_token_rows"])
def test_merge_lora_gives_a_plain_qwen2_with_the_same_outputs(folders, tmp_path, folder, lora):
    model = build(folders[folder], get_lora=lora, lora_r=4, lora_alpha=8).eval()
    _perturb(model)
    batch = samples()
    with torch.no_grad():
        before = model(batch)["loss"]
        ids = torch.tensor([model.llm.prompt.generation_prompt(SAMPLES["instruction"][0])])
        logits_before = model.llm_model(input_ids=ids).logits
    generated_before = model.generate(batch, max_new_tokens=6)

    merged = model.merge_lora()
    assert type(merged) is Qwen2ForCausalLM and model.llm_model is merged and model.llm.model is merged
    assert not any("lora_" in n or n.endswith(".rows") for n, _ in merged.named_parameters())
    # fp32: merging only reorders the sums (W + s*B@A)x vs Wx + s*B(Ax).
    with torch.no_grad():
        torch.testing.assert_close(model(batch)["loss"], before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, logits_before, rtol=1e-4, atol=1e-4)
    assert model.generate(batch, max_new_tokens=6) == generated_before

    # What export writes, transformers reads back: the same logits from a plain folder.
    merged.save_pretrained(tmp_path)
    model.llm.tokenizer.save_pretrained(tmp_path)
    reloaded = Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, logits_before, rtol=1e-4, atol=1e-4)


def test_merge_lora_without_adapters_returns_the_llm(folders):
    model = build(folders["qwen25"])
    llm = model.llm_model
    assert model.merge_lora() is llm


def test_the_llm_folder_loads_through_the_yaml(folders, tmp_path):
    storage = tmp_path / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=NUM_TRAIN, num_val=2, num_test=2))
    cfg = _run_config(tmp_path / "out", storage, folders["qwen2"], stage=2, dtype="fp32")
    loaded = load_config(write_yaml(tmp_path / "run.yaml", cfg), world_size=2)
    assert loaded.model.llm_model == str(folders["qwen2"]) and loaded.model.tokenizer is None
    model = build_model(loaded.model, loaded.run.seed)
    state = model.llm_model.state_dict()
    for name, tensor in llm_weights(folders["qwen2"]).items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


# ----------------------------------------------------------------- training on 2 processes
NUM_TRAIN = 8  # 2 optimizer steps: micro-batch 2 x 2 processes


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "demo_shapes"
    return ensure_demo_shapes(path, DemoShapesSpec(num_train=NUM_TRAIN, num_val=2, num_test=2))


def _run_config(out: Path, storage: Path, llm_dir: Path, stage: int, dtype: str, **model) -> dict:
    cfg = tiny_config(out, storage, stage=stage, dtype=dtype, micro=2, max_epoch=1, init_lr=1e-2, warmup_steps=0)
    cfg["model"].update(llm_model=str(llm_dir), tokenizer=None, freeze_vit=True, freeze_qformer=True,
                        freeze_queries=True, freeze_llm=True, **model)
    return cfg


def _train(tmp_path: Path, storage: Path, llm_dir: Path, stage: int, dtype: str, **model):
    """Run train.py on 2 processes.

    Returns: the logged losses, output_dir, the last checkpoint, the model as built before training.
    """
    out = tmp_path / "out"
    cfg_path = write_yaml(tmp_path / "run.yaml", _run_config(out, storage, llm_dir, stage, dtype, **model))
    run_train(cfg_path, nproc=2)
    losses = [m["loss"] for m in train_steps(out)]
    cfg = load_config(cfg_path, world_size=2)
    initial = build_model(cfg.model, cfg.run.seed)  # what every rank built: same seed, same folder
    return losses, out, out / "checkpoints" / f"step_{NUM_TRAIN // 4}", initial


def _checkpointed_module_keys(step_dir: Path) -> set[str]:
    files = sorted(step_dir.glob("*model_states.pt"))
    assert files, list(step_dir.iterdir())
    return set(torch.load(files[0], map_location="cpu", weights_only=False)["module"])


def _trained_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The trainable tensors a checkpoint holds, as export would read them, at any ZeRO stage."""
    plain = step_dir / "mp_rank_00_model_states.pt"  # ZeRO 0-2 keep whole tensors here
    if plain.is_file():
        return {k: v.float() for k, v in torch.load(plain, map_location="cpu", weights_only=False)["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)


def _check_lean_and_trained(losses, step_dir, initial, expected_trainable):
    assert len(losses) == NUM_TRAIN // 4 and all(math.isfinite(x) for x in losses)
    assert trainable(initial) == expected_trainable
    # Lean: the module state holds the trainable tensors and nothing of the frozen LLM, ViT or Q-Former.
    assert _checkpointed_module_keys(step_dir) == expected_trainable
    trained = _trained_weights(step_dir)
    assert set(trained) == expected_trainable
    start = dict(initial.named_parameters())
    for name in ("connector.llm_proj.weight", *[n for n in expected_trainable if ".lora_B." in n or n.endswith(".rows")]):
        assert not torch.allclose(trained[name], start[name].float()), f"{name} did not train"
    # The checkpoint loads back into a model built from the YAML: nothing unexpected, only frozen weights missing.
    missing, unexpected = initial.load_state_dict(trained, strict=False)
    assert unexpected == [] and not set(missing) & expected_trainable
    return initial


def test_frozen_llm_with_added_chatml_tokens_trains_on_2_processes(tmp_path, storage, folders):
    # ZeRO-3 in bf16: the partitioned, cast engine is the hardest case for the token-row modules.
    # LLM gradient checkpointing on: ZeRO-3 gathers each layer again for the recomputation.
    losses, out, step_dir, initial = _train(tmp_path, storage, folders["plain"], stage=3, dtype="bf16",
                                            llm_grad_checkpoint=True)
    expected = {"connector.llm_proj.weight", "connector.llm_proj.bias", "llm_model.model.embed_tokens.rows",
                "llm_model.lm_head.rows"}
    model = _check_lean_and_trained(losses, step_dir, initial, expected)
    # The tokenizer as used, with its three added tokens, is in output_dir.
    saved = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert saved.get_vocab() == initial.llm.tokenizer.get_vocab()
    assert {"<|im_start|>", "<|im_end|>", "<|image_pad|>"} <= set(saved.get_vocab())
    # Export: the trained rows land in the plain matrices; every other row is the folder's.
    merged = model.merge_lora()
    original = llm_weights(folders["plain"])
    ids = saved.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    embed, folder_embed = merged.get_input_embeddings().weight, original["model.embed_tokens.weight"]
    torch.testing.assert_close(embed[:len(folder_embed)], folder_embed, rtol=0, atol=0)
    torch.testing.assert_close(embed[ids], _trained_weights(step_dir)["llm_model.model.embed_tokens.rows"])


# ZeRO-1 runs a tied-embedding LLM: DeepSpeed alone kept its frozen lm_head.weight in every checkpoint.
@pytest.mark.parametrize("stage, dtype, folder", [(0, "fp32", "qwen25"), (1, "fp32", "qwen25_tied"),
                                                  (2, "fp32", "qwen25"), (3, "bf16", "qwen25")])
def test_lora_trains_lean_at_every_zero_stage(tmp_path, storage, folders, stage, dtype, folder):
    losses, out, step_dir, initial = _train(tmp_path, storage, folders[folder], stage=stage, dtype=dtype,
                                            get_lora=True, lora_r=4, lora_alpha=8, llm_grad_checkpoint=stage == 3)
    lora = {n for n, _ in initial.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert len(lora) == 2 * 7 * TINY_QWEN2["num_hidden_layers"]  # A and B on every linear layer of each block
    model = _check_lean_and_trained(losses, step_dir, initial, lora | {"connector.llm_proj.weight", "connector.llm_proj.bias"})
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    # The trained adapters merge: same outputs from the plain Qwen2 export would write.
    model.eval()
    with torch.no_grad():
        before = model(samples())["loss"]
        model.merge_lora()
        torch.testing.assert_close(model(samples())["loss"], before, rtol=1e-5, atol=1e-5)
