"""The DPO demo as its YAML's header says to run it (torchrun, export.py, torchrun; 2 processes, a few minutes on 2
CPU cores): the SFT model's held-out preference accuracy, printed by the reference pass, rises to >= 0.9."""
from __future__ import annotations

import json
import subprocess
import sys

from run_utils import REPO, env, run_train

DEMO = REPO / "projects" / "demo"


def test_dpo_demo_raises_held_out_preference_accuracy_above_0_9(tmp_path, monkeypatch):
    monkeypatch.setenv("LAVIS_DS_CACHE", str(tmp_path / "cache"))  # the demo data, generated on first use
    run_train(DEMO / "tiny_zero2.yaml", nproc=2, cwd=tmp_path, launcher="launch", timeout=900,
              options=("run.max_epoch=1", "run.output_dir=output/demo_sft", "run.test_splits=[]"))
    subprocess.run([sys.executable, str(REPO / "export.py"), "output/demo_sft", "--out", "exports/demo_sft"],
                   cwd=tmp_path, env=env(), check=True, capture_output=True, timeout=300)
    dpo = run_train(DEMO / "tiny_dpo.yaml", nproc=2, cwd=tmp_path, launcher="launch", timeout=900)

    out = tmp_path / "output" / "demo_dpo"
    summary = json.loads(next((out / "reference_logps").glob("*/summary.json")).read_text())
    sft_accuracy = summary["val"]["logps/accuracies"]
    assert f"val: the starting model prefers the chosen answer of {sft_accuracy:.3f} of 100 pairs" in dpo.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if r.get("split") == "val"]
    final = validations[-1]
    assert final["num_pairs"] == 100
    assert sft_accuracy < 0.8 and final["logps/accuracies"] >= 0.9, (sft_accuracy, final)
    assert final["rewards/margins"] > 0 and final["rewards/accuracies"] >= 0.85
