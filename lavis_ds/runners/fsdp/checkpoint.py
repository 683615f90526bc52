"""runner_fsdp's checkpoint files, read in one process: the DCP index checked against the files it lists, the
saved trainable shapes, and every tensor whole whatever number of processes saved them (for export and for
another engine continuing the run). ``FSDPCheckpoints`` is the engine's checkpoints part (``runners/engine.py``)."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from lavis_ds.common import safe_files
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.engine import EngineCheckpoints

CLIENT_STATE = "client_state.pt"  # the loop's state (step, scheduler, config); rank 0 writes it


def read_index(tag_dir: Path):
    """The DCP index (``.metadata``) of a checkpoint; DamagedCheckpoint if it, or a file it lists, is missing,
    unreadable or shorter than the index says."""
    from lavis_ds.runners.fsdp import dcp_reader

    try:
        metadata = dcp_reader.read_index(tag_dir)
    except safe_files.UnsafeFile:
        raise
    except Exception as e:  # noqa: BLE001  a missing or torn .metadata, whatever the reader raises
        raise ckpt.DamagedCheckpoint(f"{tag_dir / '.metadata'}: unreadable ({type(e).__name__}: {e}); the "
                                     f"checkpoint's index is missing or damaged") from None
    for info in (metadata.storage_data or {}).values():
        path = tag_dir / info.relative_path
        if not path.is_file() or path.stat().st_size < info.offset + info.length:
            raise ckpt.DamagedCheckpoint(f"{path}: " + ("file missing" if not path.is_file() else
                                                       "shorter than the checkpoint's index says (truncated)"))
    return metadata


def _saved_tensors(metadata) -> dict:
    """The saved trainable parameters' entries of a DCP index, by parameter name."""
    return {key[len("model."):]: entry for key, entry in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(entry, "size")}


def saved_shapes(metadata) -> dict[str, tuple]:
    return {name: tuple(entry.size) for name, entry in _saved_tensors(metadata).items()}


def read_everything(tag_dir: Path, prefix: str = "") -> dict:
    """The entries of a DCP checkpoint whose flat keys (``model.<name>``, ``optim.state.<name>.exp_avg``, ...) start
    with ``prefix``, whole, read by this process alone whatever number of processes saved it."""
    from lavis_ds.runners.fsdp import dcp_reader

    entries = read_index(tag_dir).state_dict_metadata  # every file there and whole, or DamagedCheckpoint naming it
    flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype) if hasattr(entry, "size") else None
            for key, entry in entries.items() if key.startswith(prefix)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp_reader.load(flat, tag_dir, no_dist=True)
    return flat


def read_trained_weights(tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(trained weights by parameter name, in fp32; the client state)`` of a complete runner_fsdp checkpoint,
    read in one process whatever number of processes saved it (for export)."""
    weights = {key[len("model."):]: tensor.float() for key, tensor in read_everything(tag_dir, "model.").items()}
    return weights, ckpt.load_file(tag_dir / CLIENT_STATE)



class FSDPCheckpoints(EngineCheckpoints):
    """runner_fsdp's checkpoint folders, read without an engine."""

    FILES = (".metadata",)  # the DCP index

    @classmethod
    def read_trained_weights(cls, tag_dir):
        weights, client_state = read_trained_weights(tag_dir)
        return weights, client_state, {"precision": ckpt.read_marker(tag_dir).get("precision", "fp32")}

    @classmethod
    def handover_shapes(cls, tag_dir, rank):
        """Carries over: the fp32 parameters and AdamW moments of precision_mode mixed (or fp32); ``low`` keeps
        them in bf16."""
        marker = ckpt.read_marker(tag_dir)
        if marker.get("precision_mode") == "low" and marker.get("precision", "fp32") != "fp32":
            raise ckpt.CheckpointError(
                f"{tag_dir} was saved by runner_fsdp with run.fsdp.precision_mode=low: its parameters and AdamW "
                f"moments are kept in {marker['precision']}, not fp32, so another engine cannot continue it exactly. "
                f"Resume with run.runner: runner_fsdp, or start afresh (--options run.resume=false)")
        # Every file there and whole, or DamagedCheckpoint naming it.
        saved = saved_shapes(read_index(tag_dir))
        ckpt.load_file(tag_dir / CLIENT_STATE, mmap=True)
        return saved

    @classmethod
    def read_handover(cls, tag_dir, scratch, rank, needed=True):
        """Every trained parameter and its AdamW moments, whole, read by this process alone (DCP without a
        process group); nothing for a rank that does not need them."""
        if not needed:
            return None
        flat = read_everything(tag_dir)
        names = [key[len("model."):] for key in flat if key.startswith("model.")]
        states, steps = {}, set()
        for name in names:
            weight = flat[f"model.{name}"].float()
            # A parameter that never had a gradient has no AdamW state yet: zero moments, as its first step makes.
            zero = torch.zeros_like(weight)
            states[name] = {"fp32": weight, "exp_avg": flat.get(f"optim.state.{name}.exp_avg", zero).float(),
                            "exp_avg_sq": flat.get(f"optim.state.{name}.exp_avg_sq", zero).float()}
            if f"optim.state.{name}.step" in flat:
                steps.add(int(flat[f"optim.state.{name}.step"]))
        return ckpt.Handover(states, max(steps, default=0), ckpt.load_file(tag_dir / CLIENT_STATE))
