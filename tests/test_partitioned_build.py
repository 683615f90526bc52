"""The LLM built where its engine shards it: ZeRO-3 partitioned from the start, FSDP empty (meta) on processes
other than 0. On 2 processes, a tiny Qwen2 folder written with save_pretrained whose tokenizer lacks the
ChatML tokens (so the embeddings are resized and the new rows train), LoRA on the LLM, LLM gradient
checkpointing, everything else frozen: what each process holds, the same losses as a whole build, and a
ZeRO-3 run that checkpoints lean, resumes exactly and exports.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import (comparable, export_matches_logged_val_loss, run_forked, run_train, tiny_config, train_steps,
                       write_yaml)
from test_llm import PLAIN_SPECIALS, qwen_folder

NUM_TRAIN = 8  # micro-batch 2 x 2 processes: 2 optimizer steps
MODEL = dict(freeze_vit=True, freeze_qformer=True, freeze_queries=True, freeze_llm=True, get_lora=True, lora_r=4,
             lora_alpha=8, llm_grad_checkpoint=True)
LLM_SIDE = {k: MODEL[k] for k in ("freeze_llm", "get_lora", "lora_r", "lora_alpha", "llm_grad_checkpoint")}


def arch_model(arch: str, storage: Path) -> dict:
    """The switches above for each registered architecture: the tower frozen, the LLM frozen with LoRA."""
    if arch == "blip2_qwen":
        return MODEL
    connector = {"qformer_tokenizer": f"{storage}/qformer_tokenizer"} if arch == "instructblip" else {}
    return {"arch": arch, "vision_tower": {"freeze": True}, "connector": connector, **LLM_SIDE}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("partitioned")
    folder = qwen_folder(root / "plain", PLAIN_SPECIALS, spare_rows=0)  # no ChatML tokens, no spare rows
    storage = ensure_demo_shapes(root / "demo_shapes", DemoShapesSpec(num_train=NUM_TRAIN, num_val=2, num_test=2))
    return root, folder, storage


def _config(out: Path, storage: Path, folder: Path, runner: str = "runner_deepspeed", arch: str = "blip2_qwen",
            **run) -> dict:
    cfg = tiny_config(out, storage, stage=3, micro=2, init_lr=1e-2, warmup_steps=0, runner=runner, **run)
    cfg["model"].update(llm_model=str(folder), tokenizer=None, **arch_model(arch, storage))
    return cfg


@pytest.mark.parametrize("arch", ["blip2_qwen", "llava", "instructblip"])
def test_other_processes_never_hold_the_whole_llm_and_losses_match_a_whole_build(setup, arch):
    """Both engines, each built in its placement and whole (as before) in one launch: process 1 holds half of
    the LLM (ZeRO-3) or none of it (FSDP) when the build ends, and the loss of one batch before and after one
    optimizer step is that of the whole build, exactly (fp32); each engine returns to the loop before the last
    backward. Every registered architecture."""
    root, folder, storage = setup
    cfg_path = write_yaml(root / f"worker_{arch}.yaml", _config(root / f"worker_out_{arch}", storage, folder,
                                                               arch=arch))
    report_path = root / f"report_{arch}.json"
    # tests/placement_worker.py on 2 processes, forked from the suite's server (tests/forked.py) as for train.py.
    proc = run_forked("placement_worker:cli", [str(cfg_path), str(report_path), "runner_deepspeed", "runner_fsdp"],
                      root / f"worker_{arch}.logs", nproc=2)
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = json.loads(report_path.read_text())

    total = reports["runner_deepspeed/whole"][1]["built"]["total"]
    # The measure sees a whole build: every process holds all of it until the engine shards it.
    for whole in (reports["runner_deepspeed/whole"], reports["runner_fsdp/whole"]):
        assert [rank["built"]["full"] for rank in whole] == [total, total]
    # ZeRO-3: each process only ever keeps its partition, resized embeddings included.
    for rank in reports["runner_deepspeed/partitioned"]:
        assert rank["built"]["full"] == 0 and rank["built"]["unpartitioned"] == [], rank
        assert total / 2 <= rank["built"]["partition"] < 0.55 * total
    # FSDP: process 0 loads the folder; process 1 builds on the meta device and receives only its shard.
    first, second = reports["runner_fsdp/partitioned"]
    assert first["built"]["full"] == total
    assert second["built"]["meta"] == total and second["built"]["full"] == 0
    for rank in (first, second):
        assert rank["wrapped"]["meta"] == rank["wrapped"]["full"] == 0
        assert 0.45 * total < rank["wrapped"]["shard"] < 0.55 * total

    for runner in ("runner_deepspeed", "runner_fsdp"):
        whole = reports[f"{runner}/whole"][0]["losses"]
        assert whole[1] < whole[0]  # the step changed the model
        for rank in reports[f"{runner}/partitioned"]:
            assert rank["losses"] == whole, runner
        # the engine returned to the loop (which starts its loss check there) before the last backward, everywhere
        for report in reports[f"{runner}/partitioned"] + reports[f"{runner}/whole"]:
            assert report["events"] == ["returned", "backward"], runner
    # FSDP2 frees each block's gathered weights after its forward, and keeps the root unit's (embeddings, head) to
    # the backward, which needs them first: resharding them would only gather them again at once
    for report in reports["runner_fsdp/partitioned"] + reports["runner_fsdp/whole"]:
        assert report["gathered"] == {"root": True, "block": False}


def _module_keys(tag_dir: Path) -> set[str]:
    files = sorted(tag_dir.glob("*model_states.pt"))
    return set(torch.load(files[0], map_location="cpu", weights_only=False)["module"])


def test_zero3_partitioned_run_checkpoints_lean_resumes_exactly_and_exports(setup, tmp_path):
    from lavis_ds.build import build_model
    from lavis_ds.config import load_config

    _, folder, storage = setup
    out = tmp_path / "run"
    cfg_path = write_yaml(tmp_path / "run.yaml", _config(out, storage, folder, save_freq_steps=1,
                                                         valid_splits=["val"], batch_size_eval=2))
    run_train(cfg_path)
    steps = train_steps(out)
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)

    # Lean: the adapters, the new token rows and the projection; nothing of the frozen LLM.
    model = build_model(load_config(cfg_path, world_size=2).model, seed=7)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_B." in name for name in trainable) and any(name.endswith(".rows") for name in trainable)
    assert _module_keys(out / "checkpoints" / "step_2") == trainable

    # Exact resume: the frozen weights come from the partitioned build again, the rest from step 1's checkpoint.
    resumed_out = tmp_path / "resumed"
    resumed = _config(resumed_out, storage, folder, resume=str(out / "checkpoints" / "step_1"))
    proc = run_train(write_yaml(tmp_path / "resumed.yaml", resumed))
    assert "resumed from" in proc.stdout
    assert comparable(train_steps(resumed_out)) == comparable(steps[1:])

    # Export, LoRA and rows merged into a plain Qwen2 folder: the validation loss the run logged at its end.
    export_matches_logged_val_loss(out, tmp_path / "export", storage)
