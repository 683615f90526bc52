"""Checks on what runs wrote (metrics.jsonl, tracebacks in their output), and across runs."""
from __future__ import annotations

import json
from pathlib import Path


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def train_steps(output_dir: Path) -> list[dict]:
    return [m for m in metrics(output_dir) if "split" not in m]


def complete_steps(out: Path) -> list[str]:
    """Training lines written so far (the file may end in a half-written line)."""
    lines = (out / "metrics.jsonl").read_text().split("\n")[:-1]
    return [line for line in lines if '"split"' not in line]


def comparable(steps: list[dict]) -> list[tuple]:
    return [(m["step"], m["epoch"], m["loss"], m["lr"], m["grad_norm"]) for m in steps]


def assert_same_steps(out: Path, reference_out: Path, steps: range, tolerance: float) -> None:
    """``out`` logged the optimizer ``steps`` and each is the reference run's step of that number: the same lr, the
    loss within ``tolerance`` relative (another engine or number of processes adds in another order)."""
    continued, expected = train_steps(out), {m["step"]: m for m in train_steps(reference_out)}
    assert [m["step"] for m in continued] == list(steps)
    for mine in continued:
        theirs = expected[mine["step"]]
        assert mine["lr"] == theirs["lr"], (mine, theirs)
        assert abs(mine["loss"] - theirs["loss"]) <= tolerance * abs(theirs["loss"]), (mine, theirs)


def tracebacks(text: str) -> list[str]:
    """The last line of every Python traceback in ``text``, except torchrun's own report of a failed worker.

    torchrun ends its own run with a traceback (ChildFailedError, SignalException) whenever a
    worker exits non-zero or it was signalled; that is the launcher's, not lavis_ds's.
    """
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            last = lines[j] if j < len(lines) else ""
            if not last.startswith("torch.distributed.elastic."):
                found.append(last)
    return found + (["Original Traceback (a DataLoader worker's)"] if "Original Traceback" in text else [])


def export_matches_logged_val_loss(out: Path, export_dir: Path, storage: Path):
    """Export ``out`` with LoRA and trained rows merged into a plain Hugging Face LLM, and check that it gives the
    validation loss the run logged at its end (demo_shapes ``storage``); returns the loaded export."""
    import pytest
    import torch

    from lavis_ds.apps.export import export_checkpoint, load_exported
    from lavis_ds.apps.generation import as_trained, eval_processors
    from lavis_ds.datasets.instruction import InstructionDataset

    exported = export_checkpoint(out, export_dir, merge_lora=True)
    merged = load_exported(exported)
    vis, text = eval_processors(exported)
    val = InstructionDataset(storage / "annotations" / "val.json", storage / "images", vis, text)
    batch, context = as_trained(merged, val.collater([val[i] for i in range(len(val))]))
    with torch.no_grad(), context:
        result = merged(batch)
    logged = [m for m in metrics(out) if m.get("split") == "val"][-1]
    assert float(result["loss_sum"] / result["num_tokens"]) == pytest.approx(logged["loss"], rel=1e-5)
    return merged
