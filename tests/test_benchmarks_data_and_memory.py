"""The data and memory benchmarks run, so that none of them breaks unnoticed (their figures are docs/benchmarks.md's
and docs/memory.md's): each at its smallest settings, checked for the lines it always prints, never for a figure.

In this process where the benchmark builds a model only; forked from the suite's server (``harness.processes``)
where it starts a process group (a DeepSpeed trainer, an all-reduce), as its command line runs it.
``benchmarks/resume_cost.py`` is not here: it launches ``train.py`` three times (a checkpoint, two resumes),
~30 s at its smallest settings.
"""
from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path

import pytest

from run_utils import run_forked

LOADER_DATA = ["--records", "16"]  # the llava records both loader benchmarks write and read (8 images)


def _in_process(script: str, argv: list[str], capsys, tmp_path: Path) -> str:
    importlib.import_module(f"benchmarks.{script}").main(argv)
    return capsys.readouterr().out


def _forked(script: str, argv: list[str], capsys, tmp_path: Path, nproc: int = 0) -> str:
    proc = run_forked(f"benchmarks.{script}:main", argv, tmp_path / "logs", nproc=nproc, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


# script: (how it runs, its smallest argv ({data}: a folder shared by the loader benchmarks), lines it always prints)
BENCHMARKS = {
    "loader_throughput": (_forked, ["--data", "{data}", "--images", "8", *LOADER_DATA, "--workers", "0", "--micro",
                                    "2", "--batches", "1", "--steps", "1"],
                          [r"^load average .* tiny BLIP2-Qwen demo step \(micro-batch 2, .* consumes \d+ samples/s$",
                           r"^ image  workers  first batch s  samples/s  x the tiny step needs  load$",
                           r"^ +64 +0 +\d", r"^ +224 +0 +\d"]),
    "packing_throughput": (_forked, ["--data", "{data}", *LOADER_DATA, "--micro", "2", "--accum", "1", "--steps", "1",
                                     "--block", "1", "--max-len", "256", "--llm-width", "64"],
                           [r"^padded, length-grouped and packed batching: tiny BLIP2-Qwen",
                            r"^mode +supervised tok/s +positions/s +padding share +median step ms +samples/step",
                            r"^padded +\d", r"^length_grouped +\d", r"^packed \(samples\) +\d",
                            r"^packed \(tokens\) +\d"]),
    "logits_memory": (_in_process, ["--tokens", "64", "--batch", "1", "--chunks", "0", "1", "--repeats", "1"],
                      [r"^logits memory: tiny BLIP2-Qwen, vocabulary 151,936, fp32, \w+; batch 1 x \d+ tokens",
                       r"^full logits +\d", r"^head in 1 call\(s\) +\d"]),
    "memory_on_paper": (_in_process, ["--no-measure"],
                        [r"^### Projection only \(zero2.yaml\)$", r"^### Projection \+ LoRA \(zero2_lora.yaml\)$",
                         r"^\| ZeRO-0 \| - \|", r"^\| ZeRO-3 \| cpu \|", r"^\| FSDP2 mixed\+cpu \| cpu \|",
                         r"^Activations \(GB\) by micro-batch"]),
    "qwen_vl_tower_memory": (_in_process, ["--side", "8", "--depth", "1"],
                             [r"^qwen2_5_vl, 1 block\(s\) .* 64 patches \(112 x 112 px\)", r"^  span: ",
                              r"^  dense: ", r"^\| span \| \d", r"^\| dense \| \d",
                              r"^dense / span memory: .*; outputs differ by"]),
    "stop_agreement": (functools.partial(_forked, nproc=2), ["--calls", "10"],
                       [r"^agree_on_step\(\): 2 processes \(\w+\), 10 calls: median \d+ us, p90 \d+ us$"]),
}


@pytest.fixture(scope="module")
def loader_data(tmp_path_factory) -> Path:
    """One data folder for both loader benchmarks: its demo_shapes and llava records are written once."""
    return tmp_path_factory.mktemp("loader_data")


@pytest.mark.parametrize("script", BENCHMARKS)
def test_the_benchmark_runs_at_its_smallest_settings(script, capsys, tmp_path, loader_data):
    runner, argv, lines = BENCHMARKS[script]
    out = runner(script, [a.format(data=loader_data) for a in argv], capsys, tmp_path)
    missing = [line for line in lines if not re.search(line, out, flags=re.MULTILINE)]
    assert not missing, f"benchmarks/{script}.py did not print {missing}:\n{out[-3000:]}"


def test_the_memory_on_paper_probe_counts_what_a_layer_saves_for_backward():
    """memory_on_paper's default path (its one-layer probe; ~5 s per table at Qwen2.5-7B's width, so the run above
    uses the formula) on a Qwen2 layer of the tiny preset's width, frozen and with the zero2_lora.yaml adapters:
    trainable adapters keep their inputs as well, so the layer saves more per token."""
    from transformers import Qwen2Config

    from benchmarks.memory_on_paper import measured_bytes_per_token_layer

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    lora = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    frozen = measured_bytes_per_token_layer(config, None, s=16)
    assert 0 < frozen < measured_bytes_per_token_layer(config, lora, s=16)
