"""The build, checkpoint, data and DPO benchmarks run at their smallest settings, so that none breaks unnoticed (their
figures are the ones docs/benchmarks.md reports). Each runs its ``main(argv)`` in this process and must print the
lines its figures are read from; the figures themselves are not checked (they are measurements).

Left out, as each launches several fresh training processes that cost more than this file's budget (tens of seconds
at their smallest settings): build_memory.py's measured mode, engine_agreement.py, launch_cost.py and
gpu_throughput.py's CPU smoke run (docs/benchmarks.md shows their commands)."""
from __future__ import annotations

import importlib
import re

import pytest

from harness.processes import LAUNCHER_VARIABLES


def _checkpoint_size(tmp_path) -> list[str]:
    return ["--get-lora"]  # LoRA: the trainable count comes from the peft-wrapped LLM, the longer path


def _build_memory(tmp_path) -> list[str]:
    return ["--on-paper", "--nproc", "2"]


def _llava_mix(tmp_path) -> list[str]:
    return ["--out", str(tmp_path / "mix"), "--records", "40"]


def _dpo_step(tmp_path) -> list[str]:
    return ["--tokens", "48", "--pairs", "1", "--repeats", "1"]


def _data_scale(tmp_path) -> list[str]:
    # the new tree only: the old one is a second train.py launch and a second lookups process, the same code path
    return ["--records", "40", "--workers", "1", "--batch", "8", "--trees", "new", "--data", str(tmp_path / "data")]


# benchmark -> (its smallest arguments, lines its output always holds)
BENCHMARKS = {
    "checkpoint_size": (_checkpoint_size, [r"^parameters: \d+\.\d\d B, trainable \d+\.\d\d M$",
                                           r"^lavis_ds checkpoint \(trainable weights \+ Adam state\): [\d,.]+ MiB$",
                                           r"^ratio whole/lean: [\d,]+x$"]),
    "build_memory": (_build_memory, [rf"^\| {llm} \([\d.]+B\) \| {engine} \| {build} \| [\d.]+ \| [\d.]+ \| \d+ \|$"
                                     for llm in ("Qwen2.5-7B", "Qwen2.5-72B")
                                     for engine, build in (("runner_deepspeed", "ZeRO-3 partitioned"),
                                                           ("runner_fsdp", "meta on processes > 0"))]),
    "llava_mix": (_llava_mix, [r": 40 records, .* question/answer pairs \(mean [\d.]+\); .*coco/train2017 \d+"]),
    "dpo_step": (_dpo_step, [r"^dpo step: tiny BLIP2-Qwen, vocabulary 151,936, fp32, cpu, ",
                             *(rf"^{re.escape(path)}\s+\d+\.\d{{3}}\s+-?\d+\.\d\d\s+\d+\.\d{{3}}\s+\d+\.\d\d$"
                               for path in ("sft (chosen sides)", "dpo", "reference pass"))]),
    "data_scale": (_data_scale, [r"^  train.py launch -> first optimizer step: \d+\.\d s ",
                                 r"^  config check \d+\.\d s .* \+ dataset build \d+\.\d s .*, \d+ records;",
                                 r"^    worker 0: RSS \d+ / USS \d+ / PSS \d+  ->  RSS \d+",
                                 r"^aims \(new\): start-up under 60 s: \d+\.\d s;"]),
}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_the_benchmark_runs_and_prints_its_figures(name, tmp_path, capsys, monkeypatch):
    arguments, lines = BENCHMARKS[name]
    for variable in LAUNCHER_VARIABLES:  # data_scale's train.py is a user's `python train.py`, not a rank of a job
        monkeypatch.delenv(variable, raising=False)  # an in-process run earlier in the session may have set them
    main = importlib.import_module(f"benchmarks.{name}").main
    main(arguments(tmp_path))  # a failure raises (the scripts exit non-zero on the same paths)
    out = capsys.readouterr().out
    missing = [line for line in lines if not re.search(line, out, flags=re.MULTILINE)]
    assert not missing, f"benchmarks/{name}.py printed no line matching {missing}:\n{out}"


def test_data_scale_refuses_no_workers_by_name(capsys):
    from benchmarks.data_scale import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--workers", "0"])
    assert "--workers 0: at least 1 (the DataLoader workers' memory is what is measured)" in capsys.readouterr().err
