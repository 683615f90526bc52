"""Throughput you can see: the FLOP function (by hand, and against torch's FlopCounterMode on the real tiny model),
the peak FLOP/s table and run.peak_tflops, and the throughput fields of a real tiny run's metrics.jsonl."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

import plain_engine  # noqa: F401  (registers runner_plain_test)
from archs import build_tiny
from conftest import demo_storage_fixture
from lavis_ds.build import build_trainer
from lavis_ds.common.errors import ConfigError
from lavis_ds.common.hardware import peak_bf16_tflops
from lavis_ds.config import load_config
from lavis_ds.models import Blip2Qwen
from lavis_ds.models.flops import Flops
from lavis_ds.models.image_tokens import GRID_KEY
from lavis_ds.runners import throughput
from run_utils import run_forked, tiny_config, train_steps, write_yaml

# The MiniGPT4Qwen recipe: ViT, Q-Former, queries and LLM frozen; only the projection trains.
MINIGPT4QWEN = {"freeze_vit": True, "freeze_qformer": True, "freeze_queries": True, "freeze_llm": True}


def _batch() -> dict:
    """Two samples of different lengths (so one is padded), one of them two turns long."""
    return {"image": torch.randn(2, 3, 64, 64),
            "instruction": [["<Img><ImageHere></Img> What is in the image?", "Describe the picture in detail."],
                            ["What color is the ball?"]],
            "output": [["A cat sitting on a mat.", "A dog runs on the grass next to a red ball."], ["It is red."]]}


# ----------------------------------------------------------------------------- the FLOP function
def test_the_tiny_preset_counted_by_hand(tiny_model_config):
    """lavis_ds/configs/models/blip2_qwen/tiny.yaml (and eva_vit_g/tiny.yaml), matmul by matmul."""
    model = Blip2Qwen.from_config(tiny_model_config)
    vocab = model.llm_model.lm_head.out_features  # the tokenizer's size
    # ViT: 64 px images in 16 px patches: 16 patches + CLS = 17 tokens, width 64, MLP 256, 2 blocks.
    patches, tokens, width, mlp = 16, 17, 64, 256
    patch_embed = 2 * patches * (3 * 16 * 16) * width
    attention = 2 * (2 * tokens * tokens * width)  # Q Kᵀ and P V
    vit_block = 2 * tokens * (3 * width * width + width * width + 2 * width * mlp) + attention  # qkv, proj, fc1, fc2
    vit = patch_embed + 2 * vit_block
    # Q-Former: 8 queries, width 64, FFN 128, 2 layers, cross-attention to the 17 image tokens in layer 0 only.
    queries, hidden, ffn = 8, 64, 128
    self_attention = 2 * queries * 4 * hidden * hidden + 2 * (2 * queries * queries * hidden)  # q, k, v, out
    cross_attention = (2 * queries * 2 * hidden * hidden + 2 * tokens * 2 * width * hidden  # q, out | k, v
                       + 2 * (2 * queries * tokens * hidden))
    feed_forward = 2 * queries * 2 * hidden * ffn
    qformer = 2 * (self_attention + feed_forward) + cross_attention
    projector = 2 * queries * hidden * 64
    # LLM: width 64, 4 query heads and 2 KV heads of 16 (q 64, k and v 32 wide), MLP 128, 2 layers, output head.
    llm_weights = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)  # N of the decoder, embeddings left out
    head = 64 * vocab
    llm_attention = 2 * (2 * 64 + 2 * 64)  # per T²: Q Kᵀ and P V over 4 heads x 16, 2 layers

    flops = model.flop_model()
    # Everything trains: every matmul 3x its forward, except the patch embedding (the image needs no gradient).
    assert flops.tower == Flops(vit, 3 * vit - patch_embed)
    assert flops.connector == Flops(qformer + projector, 3 * (qformer + projector))
    assert flops.llm_per_token == Flops(2 * llm_weights, 6 * llm_weights)  # 6N
    assert flops.llm_attention == Flops(llm_attention, 3 * llm_attention)  # 12·L·H·Q per T²
    assert flops.head == Flops(2 * head, 6 * head) and not flops.head_at_every_position

    recipe = Blip2Qwen.from_config({**tiny_model_config, **MINIGPT4QWEN}).flop_model()
    # Nothing below the ViT and the Q-Former trains: forward only. The projection's input needs no gradient (its
    # weight's does: 2x); the frozen LLM passes the gradient down to it (dX but no dW: 4N, not 6N); attention's
    # two activation operands both need one (3x).
    assert recipe == type(recipe)(Flops(vit, vit), Flops(qformer + projector, qformer + 2 * projector),
                                  Flops(2 * llm_weights, 4 * llm_weights), Flops(llm_attention, 3 * llm_attention),
                                  Flops(2 * head, 4 * head))
    # The head runs at the 4 supervised positions only (lavis_ds.models.lm_loss).
    assert recipe.per_sample(10, supervised=4)["llm"] == Flops(10 * 2 * llm_weights + 100 * llm_attention,
                                                                10 * 4 * llm_weights + 300 * llm_attention)
    assert recipe.per_sample(10, supervised=4)["head"] == Flops(4 * 2 * head, 4 * 4 * head)
    full_logits = Blip2Qwen.from_config({**tiny_model_config, **MINIGPT4QWEN, "loss_chunks": 0}).flop_model()
    assert full_logits.head_at_every_position and full_logits.per_sample(10, 4)["head"] == recipe.head * 10


def test_the_full_size_preset_on_the_meta_device(tiny_tokenizer_dir):
    """qwen2.5_7b_instruct (the MiniGPT4Qwen recipe) from its YAML sizes: 4N + 12·L·H·Q·T per token for the frozen
    LLM under the trained projection; EVA-ViT-G and BLIP-2's Q-Former forward only."""
    cfg = {**Blip2Qwen.default_config("qwen2.5_7b_instruct"), "tokenizer": str(tiny_tokenizer_dir),
           "load_pretrained": False}
    with torch.device("meta"):
        flops = Blip2Qwen.from_config(cfg).flop_model()
    h, kv, mlp, layers, vocab = 3584, 4 * 128, 18944, 28, 152064
    n = layers * (h * h + 2 * h * kv + h * h + 3 * h * mlp)  # 6.53e9: Qwen2.5-7B's decoder
    assert flops.llm_per_token == Flops(2 * n, 4 * n)
    assert flops.head == Flops(2 * h * vocab, 4 * h * vocab)
    assert flops.llm_attention == Flops(4 * layers * h, 12 * layers * h)  # 28 heads x 128 = the width
    tokens, width, depth = 257, 1408, 39  # 224 px in 14 px patches + CLS; 6144 MLP units
    vit = 2 * 256 * (3 * 14 * 14) * width + depth * (2 * tokens * (4 * width * width + 2 * width * 6144)
                                                       + 4 * tokens * tokens * width)
    assert flops.tower == Flops(vit, vit)
    queries, hidden = 32, 768  # 12 layers, cross-attention in 6 of them, FFN 3072
    qformer = (12 * (2 * queries * (4 * hidden * hidden + 2 * hidden * 3072) + 4 * queries * queries * hidden)
               + 6 * (2 * queries * 2 * hidden * hidden + 2 * tokens * 2 * width * hidden
                      + 4 * queries * tokens * hidden))
    assert flops.connector == Flops(qformer + 2 * queries * hidden * h, qformer + 4 * queries * hidden * h)


def test_the_vision_side_is_counted_per_image_for_none_or_several(tiny_model_config):
    """A text-only sample and a two-image one: the towers run on two images, as the counts say (test_flops checks the
    formula against FlopCounterMode for every architecture)."""
    model = Blip2Qwen.from_config({**tiny_model_config, **MINIGPT4QWEN})
    batch = {"image": torch.randn(2, 3, 64, 64), "num_images": [0, 2],
             "instruction": [["What color is the ball?"], ["<Img><ImageHere></Img> <Img><ImageHere></Img> Same?"]],
             "output": [["It is red."], ["No, the second one is darker."]]}
    batch = model.prepare_batch(batch)  # on the host, as the loop's data side prepares every micro-batch
    counts = throughput.count_tokens([batch])
    assert (counts.samples, counts.images) == (2, 2)


def test_qwen_vl_images_are_counted_by_grid_row_with_their_sizes(tiny_tokenizer_dir, tmp_path):
    """One count per image (not per patch of the flat ``image``), and each image's grid, which its FLOPs read."""
    model = build_tiny("qwen2_vl", tiny_tokenizer_dir, tmp_path)
    visuals = [model.vision_tower.processing.still_patches(torch.randn(3, h, w)) for h, w in ((56, 56), (56, 112))]
    batch = {"image": torch.cat([v.pixel_values for v in visuals]), GRID_KEY: torch.stack([v.grid_thw for v in visuals]),
             "num_images": [0, 2], "instruction": [["Hi?"], ["<Img><ImageHere></Img> <Img><ImageHere></Img> Same?"]],
             "output": [["Hello."], ["No."]]}
    counts = throughput.count_tokens([model.prepare_batch(batch)])
    assert counts.images == 2 and counts.image_sizes == Counter({(1, 4, 4): 1, (1, 4, 8): 1})
    flops = model.flop_model()
    two_images = flops.per_sample(0, 0, image_sizes=[(1, 4, 4), (1, 4, 8)])
    one_each = [flops.per_sample(0, 0, image_sizes=[size]) for size in ((1, 4, 4), (1, 4, 8))]
    assert 0 < one_each[0]["tower"].forward < one_each[1]["tower"].forward  # a larger image costs more
    assert flops.training_flops(2, 0, 0, 0, image_sizes=counts.image_sizes) == pytest.approx(
        two_images["total"].training, rel=1e-12)


def test_tokens_are_counted_on_the_cpu_and_the_forward_reuses_them(tiny_model_config):
    model = Blip2Qwen.from_config(tiny_model_config)
    batch, untouched = _batch(), _batch()
    untouched["image"] = batch["image"]
    batch = model.prepare_batch(batch)
    counts = throughput.count_tokens([batch])
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    assert batch["input_ids"].device.type == "cpu" and lengths[0] > lengths[1]
    assert counts == throughput.TokenCounts(samples=2, images=2, positions=2 * lengths[0], tokens=sum(lengths),
                                            supervised=int((batch["labels"] != -100).sum()),
                                            squared_tokens=sum(n * n for n in lengths),
                                            image_sizes=Counter({(64, 64): 2}))
    assert counts.supervised < counts.tokens < counts.positions
    torch.manual_seed(0)
    reused = model(batch)
    torch.manual_seed(0)
    assert torch.equal(reused["loss"], model(untouched)["loss"])
    assert reused["num_tokens"] == counts.supervised


# ----------------------------------------------------------------------------- peaks and run.peak_tflops
@pytest.mark.parametrize("name, peak", [
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989),
    # Not in the table: no MFU rather than a guessed one.
    ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA GeForce RTX 3090", None), ("CPU", None),
])
def test_the_peak_table_by_device_name(name, peak):
    assert peak_bf16_tflops(name) == peak


def test_the_peak_comes_from_run_peak_tflops_else_the_device():
    assert throughput.peak_tflops(42.5, "fp32") == (42.5, None)
    peak, note = throughput.peak_tflops(None, "bf16")
    assert peak is None and "MFU is not logged" in note and "run.peak_tflops" in note  # this machine: a CPU


demo_storage = demo_storage_fixture(num_train=16, num_val=8, num_test=8)


def _config(out, demo_storage, **run) -> dict:
    """The tiny model on 16 demo samples: 2 optimizer steps of micro-batches 4 x accumulation 2, in this process."""
    return tiny_config(out, demo_storage, accum=2, runner="runner_plain_test", **run)


@pytest.mark.parametrize("value, message", [
    (0, r"run\.peak_tflops: 0 is out of range; valid: > 0"),
    ("fast", r"run\.peak_tflops: expected float \| null, got 'fast'"),
])
def test_a_bad_peak_tflops_is_a_config_error(tmp_path, demo_storage, value, message):
    cfg = write_yaml(tmp_path / "run.yaml", _config(tmp_path / "out", demo_storage, peak_tflops=value))
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)


# ----------------------------------------------------------------------------- a real run's metrics.jsonl
def _train(tmp_path, demo_storage, monkeypatch, **run) -> tuple[list[dict], list[list[torch.Tensor]], list, object]:
    """Train in-process; (the logged steps, each step's micro-batches' attention masks, each step's micro-batches'
    supervised tokens per sample, the trainer)."""
    masks, supervised = [], []

    def recording(micro_batches):
        counts = count_tokens(micro_batches)
        masks.append([batch["attention_mask"] for batch in micro_batches])
        supervised.append([(batch["labels"][:, 1:] != -100).sum(dim=1) for batch in micro_batches])
        return counts

    count_tokens = throughput.count_tokens
    monkeypatch.setattr(throughput, "count_tokens", recording)
    trainer = build_trainer(load_config(write_yaml(tmp_path / "run.yaml", _config(tmp_path / "out", demo_storage,
                                                                                  **run))))
    trainer.train()
    return train_steps(tmp_path / "out"), masks, supervised, trainer


def test_a_run_logs_tokens_padding_memory_and_no_mfu_on_a_cpu(tmp_path, demo_storage, monkeypatch, capsys):
    steps, masks, _, _ = _train(tmp_path, demo_storage, monkeypatch)
    assert len(steps) == 2 == len(masks)
    for step, step_masks in zip(steps, masks):
        tokens = sum(int(mask.sum()) for mask in step_masks)
        positions = sum(mask.numel() for mask in step_masks)
        assert step["tokens_per_sec"] > 0 and 0 < step["supervised_tokens_per_sec"] < step["tokens_per_sec"]
        assert 0 <= step["padding_share"] < 1
        assert step["padding_share"] == pytest.approx(1 - tokens / positions, rel=1e-12)
        # Both rates divide by the same training time.
        assert step["tokens_per_sec"] / step["samples_per_sec"] == pytest.approx(tokens / 8, rel=1e-9)
        assert step["peak_memory_gib"] > 0.01  # the process's peak RSS on a CPU
        assert step["tflops_per_device"] > 0 and "mfu" not in step
    assert capsys.readouterr().err.count("MFU is not logged") == 1  # one note, not one per step


def test_mfu_is_achieved_flops_over_run_peak_tflops(tmp_path, demo_storage, monkeypatch):
    peak = 0.5  # TFLOP/s, made up for a CPU
    steps, masks, supervised, trainer = _train(tmp_path, demo_storage, monkeypatch, peak_tflops=peak)
    flop_model = trainer.engine.module.flop_model()
    for step, step_masks, step_supervised in zip(steps, masks, supervised):
        lengths = [int(n) for mask in step_masks for n in mask.sum(dim=1)]
        answers = [int(n) for counts in step_supervised for n in counts]
        flops = sum(flop_model.per_sample(n, s)["total"].training for n, s in zip(lengths, answers))
        seconds = sum(lengths) / step["tokens_per_sec"]  # the meter's training time of this step
        assert step["mfu"] == pytest.approx(flops / seconds / (peak * 1e12), rel=1e-9)
        assert step["mfu"] == pytest.approx(step["tflops_per_device"] / peak, rel=1e-12)


# ----------------------------------------------------------------------------- the step-time benchmarks
def _benchmark(tmp_path, demo_storage, script: str, *args: str):
    """``benchmarks/<script>.py``'s ``main`` on 2 processes forked from the suite's server (as torchrun runs it), for
    2 timed steps after 1 warm-up step, on the tiny model and 16 demo samples (2 steps of 4 x 2 processes)."""
    cfg = write_yaml(tmp_path / "bench.yaml", tiny_config(tmp_path / "out", demo_storage))
    argv = ["--cfg-path", str(cfg), "--steps", "2", "--block", "1", "--warmup", "1", "--distinct", "2", *args]
    proc = run_forked(f"benchmarks.{script}:main", argv, tmp_path / "logs", nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_the_step_time_benchmark_runs_both_loops_on_two_processes(tmp_path, demo_storage):
    """So that it cannot break unnoticed: its figures are the ones docs/benchmarks.md reports."""
    figures = tmp_path / "figures.json"
    stdout = _benchmark(tmp_path, demo_storage, "step_time", "--json", str(figures))
    assert "ratio trainer/raw (medians, rank 0): " in stdout and "; rank 1: " in stdout
    written = json.loads(figures.read_text())
    assert written["trainer"]["median"] > 0 and written["raw"]["median"] > 0 and written["paired_ratio"] > 0
    assert written["world_size"] == 2 and written["global_batch"] == 8 and written["tokens"] > 0


def test_the_step_profile_benchmark_times_every_phase_of_the_step(tmp_path, demo_storage):
    stdout = _benchmark(tmp_path, demo_storage, "step_profile")
    # "rest" (the whole step less the phases timed in it) is a difference of two noisy figures, and over two steps
    # it has printed below zero: a negative figure is a figure
    phases = dict(re.findall(r"^  (\S.*?)\s+(-?\d+\.\d{3})", stdout, flags=re.MULTILINE))
    # every wrapped phase ran (the agreement's all-reduce: an epoch's first step only, not among the timed two)
    assert {"count_tokens", "unit_counts", "seed_everything", "loss check start", "loss check finish", "forward_backward",
            "last backward", "optimizer_step", "scheduler", "after_step hooks", "rest", "whole step"} <= set(phases)
    assert 0 < float(phases["forward_backward"]) < float(phases["whole step"])


def test_the_host_image_path_benchmark_measures_every_stage_and_the_loader(capsys):
    """``benchmarks/host_image_path.py`` in this process on a few small records, so that it cannot break unnoticed
    (its figures are docs/benchmarks.md's): every stage and the loader give a rate, and it says how many workers."""
    from benchmarks.host_image_path import main

    main(["--records", "32", "--images-per-folder", "1", "--stage-samples", "8", "--repeats", "1",
          "--loader-batches", "1", "--workers", "0", "--max-len", "2048", "--max-image-tokens", "64"])
    out = capsys.readouterr().out
    rates = dict(re.findall(r"^(\S.*?)\s+(\d+\.\d)\s+\d+\.\d\d$", out, flags=re.MULTILINE))
    assert len(rates) == 7 and all(float(rate) > 0 for rate in rates.values()), out
    assert re.search(r"^\s+0\s+\d+\.\d\d\s+\d+\.\d\s+\d+\s+1\.00", out, flags=re.MULTILINE), out  # 0 workers' row
    assert re.search(r"-> \d+ worker\(s\) at full use", out), out
