"""The DPO demo as its YAML's header says to run it (train, export, train; 2 processes, a few minutes on 2 CPU
cores): the SFT model's held-out preference accuracy, printed by the reference pass, rises to >= 0.9. The three
commands' `main()`s run in processes forked from the suite's server (tests about the launchers themselves start
`torchrun` and `python export.py`: test_train, test_export)."""
from __future__ import annotations

import json
import shutil

from run_utils import REPO, run_forked, run_train

DEMO = REPO / "projects" / "demo"


def test_dpo_demo_raises_held_out_preference_accuracy_above_0_9(tmp_path, monkeypatch):
    monkeypatch.setenv("LAVIS_DS_CACHE", str(tmp_path / "cache"))  # the demo data, generated on first use
    for name in ("tiny_zero2.yaml", "tiny_dpo.yaml"):  # copied: a forked job keeps its logs beside its YAML
        shutil.copy(DEMO / name, tmp_path / name)
    run_train(tmp_path / "tiny_zero2.yaml", nproc=2, cwd=tmp_path, timeout=900,
              options=("run.max_epoch=1", "run.output_dir=output/demo_sft", "run.test_splits=[]"))
    export = run_forked("lavis_ds.apps.export:main", ["output/demo_sft", "--out", "exports/demo_sft"],
                        tmp_path / "export_logs", cwd=tmp_path, timeout=300)
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-4000:]
    dpo = run_train(tmp_path / "tiny_dpo.yaml", nproc=2, cwd=tmp_path, timeout=900)

    out = tmp_path / "output" / "demo_dpo"
    summary = json.loads(next((out / "reference_logps").glob("*/summary.json")).read_text())
    sft_accuracy = summary["val"]["logps/accuracies"]
    distinct = summary["val"]["distinct"]  # pairs of identical content are scored once
    assert f"val: the starting model prefers the chosen answer of {sft_accuracy:.3f} of 100 pairs ({distinct} " \
           f"distinct)" in dpo.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if r.get("split") == "val"]
    final = validations[-1]
    assert final["num_pairs"] == 100
    assert sft_accuracy < 0.8 and final["logps/accuracies"] >= 0.9, (sft_accuracy, final)
    assert final["rewards/margins"] > 0 and final["rewards/accuracies"] >= 0.85
