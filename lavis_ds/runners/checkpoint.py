"""Checkpoint folders on disk: naming, completeness markers, RNG states.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/``. DeepSpeed writes its
files there from every rank; after all ranks are done, rank 0 writes
``lavis_ds_complete.json``. Only folders with that marker are ever resumed
from, so a run killed mid-save falls back to the previous checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

COMPLETE_MARKER = "lavis_ds_complete.json"
_TAG = re.compile(r"^step_(\d+)$")


def tag_for(global_step: int) -> str:
    return f"step_{global_step}"


def is_complete(tag_dir: Path) -> bool:
    return (Path(tag_dir) / COMPLETE_MARKER).is_file()


def latest_complete(ckpt_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``ckpt_dir``, if any."""
    if not Path(ckpt_dir).is_dir():
        return None
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).iterdir()
             if (m := _TAG.match(p.name)) and is_complete(p)]
    return max(found)[1] if found else None


def mark_complete(tag_dir: Path, info: dict) -> None:
    tmp = Path(tag_dir) / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, Path(tag_dir) / COMPLETE_MARKER)  # atomic: the marker is whole or absent


def rng_states() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_states(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def rng_file(tag_dir: Path, rank: int) -> Path:
    return Path(tag_dir) / f"rng_state_rank{rank}.pt"
