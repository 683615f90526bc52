"""The shared vision-LLM core: Blip2Qwen's names, the forward as its parts composed by hand, and the LM head at the
supervised positions only (loss, gradients and per-sample log-probs equal the full-logits path's)."""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from families import FAMILIES, tokenizer_dir
from lavis_ds.models import Blip2Qwen
from lavis_ds.models.llm import base_llm
from lavis_ds.models.lm_loss import head_loss_supported
from lavis_ds.models.prompt import IGNORE_INDEX

SAMPLES = {"num_images": [1, 0, 2],
           "instruction": [["<Img><ImageHere></Img> What is in the image?"], ["Say hello.", "Again?"],
                           ["<Img><ImageHere></Img> <Img><ImageHere></Img> Compare them."]],
           "output": [["A red circle."], ["Hello there.", "Hello again, friend."], ["The same blue square."]]}


def samples() -> dict:
    return {"image": torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1)), **SAMPLES}


def reordered(order: list[int]) -> dict:
    """``samples()`` listed in ``order`` (each sample's images move with it)."""
    batch = samples()
    starts = [0, 1, 1]  # the first image of each sample in the flat tensor (1, 0 and 2 images)
    images = [batch["image"][starts[i] + k] for i in order for k in range(SAMPLES["num_images"][i])]
    return {"image": torch.stack(images), **{key: [SAMPLES[key][i] for i in order] for key in SAMPLES}}


def build(tokenizer, family: str = "qwen2.5", **overrides) -> Blip2Qwen:
    cfg = Blip2Qwen.default_config("tiny")
    cfg.update(tokenizer=str(tokenizer), **FAMILIES[family].model, **overrides)
    cfg["llm_config"] = {**cfg["llm_config"], "model_type": FAMILIES[family].model_type, "head_dim": 16}
    torch.manual_seed(0)
    return Blip2Qwen.from_config(cfg).train()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_llm_tokenizers")
    return {name: tokenizer_dir(root / name, name) for name in ("qwen2.5", "llama3.2", "gemma2")}


def test_blip2_qwen_holds_the_eva_tower_and_qformer_connector(tiny_tokenizer_dir):
    """The parts' names, in the order the engines' flat optimizer states follow; MiniGPT4Qwen's flat names
    (``visual_encoder.*``, ...) map onto them (``RENAMED_KEYS``, tests/test_blip2_qwen_checkpoints.py)."""
    model = build(tiny_tokenizer_dir)
    tops = list(dict.fromkeys(key.split(".")[0] for key in model.state_dict()))
    assert tops == ["vision_tower", "llm_model", "connector"]
    keys = set(model.state_dict())
    assert {"connector.llm_proj.weight", "connector.llm_proj.bias", "connector.ln_vision.weight",
            "llm_model.model.embed_tokens.weight", "llm_model.lm_head.weight",
            "vision_tower.vit.blocks.0.attn.qkv.weight",
            "connector.qformer.encoder.layer.0.crossattention.attention.query.weight",
            "connector.query_tokens"} <= keys
    renamed = {old: new for old, new in Blip2Qwen.RENAMED_KEYS}
    assert {new.split(".")[0] for new in renamed.values()} == {"vision_tower", "connector"}


def test_forward_is_the_image_path_spliced_into_the_llm(tiny_tokenizer_dir):
    """loss = CE(LLM(token embeddings with encode_images' features at the placeholders)), composed by hand."""
    model = build(tiny_tokenizer_dir, loss_chunks=0).eval()  # no dropout: two passes see the same numbers
    batch = model.prepare_batch(samples())
    features = model.image_path.encode(batch["image"], batch)
    ids = batch["input_ids"]
    embeds = model.llm_model.get_input_embeddings()(ids).clone()
    embeds[ids == model.llm.prompt.image_token_id] = features.reshape(-1, features.shape[-1])
    logits = model.llm_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    where = targets != IGNORE_INDEX
    expected = F.cross_entropy(logits[:, :-1][where].float(), targets[where], reduction="sum")
    out = model(batch)
    assert torch.equal(out["loss_sum"], expected)
    assert out["num_tokens"] == (targets != IGNORE_INDEX).sum() > 0


def _loss_and_grads(model: Blip2Qwen, batch: dict, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.llm.loss_chunks = chunk
    model.zero_grad()
    out = model(batch)
    out["loss"].backward()
    return out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,options", [
    ("qwen2.5", {}), ("qwen2.5", {"packed": True}), ("qwen2.5", {"get_lora": True}),
    ("qwen2.5", {"llm_grad_checkpoint": True}), ("llama3.2", {}), ("gemma2", {}),
])
def test_chunked_head_loss_and_gradients_equal_the_full_logits_path(tokenizers, family, options):
    options = dict(options)
    packed = options.pop("packed", False)
    model = build(tokenizers[family], family, **options, **({"freeze_llm": True} if "get_lora" in options else {}))
    # Dropout off (the Q-Former's, LoRA's) so that two passes see the same numbers; grad checkpointing follows
    # the layers' own training flag, kept on.
    model.eval()
    for layer in (model.repeated_blocks() if options.get("llm_grad_checkpoint") else []):
        layer.training = True
    if family == "gemma2":  # the soft-capping must matter in the numbers, or the test could not see it missing
        assert base_llm(model.llm_model).config.final_logit_softcapping == 30.0
    assert head_loss_supported(base_llm(model.llm_model))
    batch = model.prepare_batch(samples(), pack_to=128 if packed else None)
    full_loss, full_grads = _loss_and_grads(model, batch, 0)
    for chunk in (1, 5, 100):  # one call; several; more calls than supervised tokens (some empty)
        loss, grads = _loss_and_grads(model, batch, chunk)
        # 1e-6 relative: a few fp32 roundings (ULP at 6.0 is 4.8e-7) from summing the token losses in another order.
        torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
        assert grads.keys() == full_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, full_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def _manual_answer_logps(model: Blip2Qwen, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample of a padded batch: the log_softmax of the full logits at each supervised target, summed."""
    features = model.image_features(batch)
    embeds = model.image_path.embed(batch["input_ids"], features)
    logits = model.llm_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    where = targets != IGNORE_INDEX
    picked = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * where).sum(1), where.sum(1)


@pytest.mark.parametrize("chunk", [0, 4])
def test_answer_logps_are_each_samples_summed_log_softmax_padded_or_packed(tiny_tokenizer_dir, chunk):
    model = build(tiny_tokenizer_dir, loss_chunks=chunk).eval()
    with torch.no_grad():
        # Lengths 79, 90 and 60 tokens: packed into rows of 150 as [0, 2] and [1].
        batch = reordered([1, 2, 0])
        padded = model.prepare_batch(batch)
        expected, counts = _manual_answer_logps(model, padded)
        logps, num = model.answer_logps(batch)
        torch.testing.assert_close(logps, expected, rtol=1e-6, atol=0)  # sums of ~15 log-probs near -10 each
        assert num.tolist() == counts.tolist() and min(num.tolist()) > 0
        packed = model.prepare_batch(batch, pack_to=150)
        assert packed["order"] == [0, 2, 1]  # results still in sample order
        packed_logps, packed_num = model.answer_logps(packed, image_features=model.image_features(packed))
        torch.testing.assert_close(packed_logps, expected, rtol=1e-5, atol=0)  # another attention mask path
        assert packed_num.tolist() == counts.tolist()


def test_answer_logps_share_one_vision_pass_and_carry_gradients(tiny_tokenizer_dir):
    model = build(tiny_tokenizer_dir).eval()
    chosen = model.prepare_batch(samples())
    features = model.image_features(chosen)
    rejected = model.prepare_batch({**samples(), "output": [["A green star."], ["Bye.", "Bye."], ["Different."]]})
    (chosen_logps, _), (rejected_logps, _) = (model.answer_logps(b, image_features=features)
                                              for b in (chosen, rejected))
    (chosen_logps - rejected_logps).sum().backward()
    assert model.connector.llm_proj.weight.grad.abs().sum() > 0 and model.connector.query_tokens.grad.abs().sum() > 0


def test_a_family_the_head_path_cannot_reproduce_uses_the_full_logits(tiny_tokenizer_dir):
    """Cohere scales its logits (`logit_scale`): the chunked setting falls back to the model's own forward."""
    cfg = Blip2Qwen.default_config("tiny")
    cfg.update(tokenizer=str(tiny_tokenizer_dir), loss_chunks=4)
    cfg["llm_config"] = {**cfg["llm_config"], "model_type": "cohere", "logit_scale": 0.5}
    torch.manual_seed(0)
    model = Blip2Qwen.from_config(cfg).eval()
    assert not head_loss_supported(base_llm(model.llm_model))
    loss = model(samples())["loss"]
    model.llm.loss_chunks = 0
    assert torch.equal(loss, model(samples())["loss"])


def test_negative_loss_chunks_is_refused(tiny_tokenizer_dir):
    cfg = {**Blip2Qwen.default_config("tiny"), "tokenizer": str(tiny_tokenizer_dir), "loss_chunks": -1}
    with pytest.raises(ValueError, match=r"loss_chunks must be >= 0 \(0: full logits\), got -1"):
        Blip2Qwen.from_config(cfg)


@pytest.fixture(scope="module")
def demo_storage(tmp_path_factory):
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

    storage = tmp_path_factory.mktemp("demo") / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=32, num_val=16, num_test=8))
    return storage


@pytest.mark.parametrize("runner,stage", [("runner_deepspeed", 3), ("runner_fsdp", 2)])
def test_chunked_head_takes_the_full_logits_steps_on_sharded_engines(tmp_path, demo_storage, runner, stage):
    """ZeRO-3 gathers the head in its module hooks at every chunk, FSDP2 unshards it with the root: 2 processes,
    4 steps with the head called 3 times (ranks hold different numbers of supervised tokens) take the steps of the
    full logits."""
    from run_utils import run_train, tiny_config, train_steps, write_yaml

    losses = {}
    for chunk in (0, 3):
        out = tmp_path / f"chunk{chunk}"
        cfg = tiny_config(out, demo_storage, stage=stage, runner=runner)
        cfg["datasets"]["demo_shapes"]["build_info"]["num_train"] = 32  # 4 steps of 4 samples x 2 processes
        cfg["model"]["loss_chunks"] = chunk
        run_train(write_yaml(tmp_path / f"chunk{chunk}.yaml", cfg))
        losses[chunk] = [step["loss"] for step in train_steps(out)]
    assert len(losses[0]) == 4
    torch.testing.assert_close(losses[3], losses[0], rtol=1e-5, atol=0)


class HostSyncs(TorchDispatchMode):
    """The operations a lavis_ds line runs that make the host wait for a GPU: ``.item()``/``int()``/``bool()`` of a
    tensor, ``nonzero``, ``masked_select``, ``torch.equal`` and indexing with a boolean mask (its size is known only
    once the device has counted it). Seen on the CPU through the dispatcher; on a GPU, tests/gpu counts them with
    CUDA's sync debug mode. Operations transformers' own lines run are not counted (not ours to change)."""

    SYNCING = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.masked_select.default",
               "aten.is_nonzero.default", "aten.equal.default"}
    INDEXING = {"aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"}

    def __init__(self):
        super().__init__()
        self.lines = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = str(func) in self.INDEXING and any(
            torch.is_tensor(t) and t.dtype == torch.bool for t in (args[1] or ()))
        if str(func) in self.SYNCING or bool_index:
            caller = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
            if "/lavis_ds/" in caller.filename:
                self.lines.append(f"{func} at {caller.filename.split('/lavis_ds/')[-1]}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("pack_to", [None, 128])
def test_a_prepared_batch_runs_forward_and_backward_without_a_host_sync(tiny_tokenizer_dir, pack_to):
    """The supervised positions are found on the host (``lay_out``); the device's forward, backward and the
    per-sample log-probs of preference objectives then make the host wait nowhere in lavis_ds's own lines, so a
    step's micro-batches queue on the GPU back to back (each boolean-mask index was a wait)."""
    model = build(tiny_tokenizer_dir, loss_chunks=2)
    batch = model.prepare_batch(samples(), pack_to=pack_to)
    with HostSyncs() as syncs:
        model(batch)["loss"].backward()
        model.answer_logps(batch)
    assert syncs.lines == []
    stale = {**batch, "labels": batch["labels"].masked_fill(batch["labels"] == batch["labels"].max(), IGNORE_INDEX)}
    with pytest.raises(RuntimeError, match="supervised_positions do not match its labels"):
        model(stale)
