"""lmms-eval's models on the demo's offline caption task, in-process: what docs/models.md's lmms-eval column is
checked with (tests/test_export_hf_arch.py for LLaVA, BLIP-2 and InstructBLIP, tests/test_qwen_vl_arch.py for
Qwen2-VL and Qwen2.5-VL).

A model is lmms-eval's name with its ``--model_args`` (as ``lmms-eval --model NAME --model_args ...`` builds it), or
lavis_ds's own model class on a model in memory (what ``--model lavis_ds`` builds from a folder).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from run_utils import REPO

TASKS = REPO / "projects" / "demo" / "lmms_eval"
TASK = "demo_shapes_caption"
LIMIT = 3  # documents: three images, one question
# lmms-eval's models on the CPU in fp32 (llava_hf takes a dtype; instructblip and qwen2_vl load the folder's, fp32;
# huggingface loads bf16 whatever it is told).
CPU_ARGS = {"llava_hf": "device=cpu,device_map=cpu,dtype=float32", "huggingface": "device=cpu,device_map=cpu",
            "instructblip": "device=cpu", "qwen2_vl": "device=cpu,device_map=cpu",
            "qwen2_5_vl": "device=cpu,device_map=cpu"}


@contextlib.contextmanager
def offline(demo_storage: Path, cache: Path) -> Iterator[None]:
    """The demo task's images are ``demo_storage``'s test images; nothing reaches the network. lmms-eval's models
    skip their ``clean()`` after an evaluation: two full ``gc.collect()`` calls, seconds in a test process that holds
    a session's objects, which free memory and change no answer."""
    from lmms_eval.api.model import lmms

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lmms, "clean", lambda self: None)
        for name, value in (("LAVIS_DS_DEMO_DATA", str(demo_storage)), ("HF_HUB_OFFLINE", "1"),
                            ("HF_DATASETS_OFFLINE", "1"), ("LMMS_EVAL_DATASETS_CACHE", str(cache))):
            patch.setenv(name, value)
        yield


def caption_answers(model, model_args: str | None = None, limit: int = LIMIT) -> list[str]:
    """The answers, in document order, that ``model`` (an lmms-eval model name, or an lmms-eval model instance)
    gives the demo's caption task on its first ``limit`` documents. Run inside :func:`offline`."""
    from lmms_eval import evaluator
    from lmms_eval.tasks import TaskManager

    result = evaluator.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], limit=limit,
                                       task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                                       log_samples=True)
    return [sample["filtered_resps"][0] for sample in sorted(result["samples"][TASK], key=lambda s: s["doc_id"])]


def question() -> str:
    """The caption task's question (what each request's text is)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_lmms_eval_utils", TASKS / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CAPTION_PROMPT


def eval_where_rank_1_lacks_the_model(argv: list[str]) -> int:
    """``lavis-ds eval`` whose rank 1 is told of a model folder that is not there, as on a node without the
    checkpoint; the other ranks load it."""
    import os

    from lavis_ds.apps.eval import main

    if os.environ.get("RANK") == "1":
        at = argv.index("--model") + 1
        argv = [*argv[:at], f"{argv[at]}_not_on_this_node", *argv[at + 1:]]
    return main(argv)


def lmms_eval_command_line(argv: list[str]) -> int:
    """lmms-eval's own command line with ``argv``, as its ``lmms-eval`` console script runs it: ``sys.argv`` read by
    ``cli_evaluate``, which catches an evaluation's error on each process, prints it and returns."""
    import sys

    from lmms_eval.__main__ import cli_evaluate

    sys.argv = ["lmms-eval", *argv]
    cli_evaluate()
    return 0
