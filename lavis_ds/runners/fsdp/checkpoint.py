"""runner_fsdp's checkpoint files, read in one process: the DCP index checked against the files it lists, the
saved trainable shapes, and every tensor whole whatever number of processes saved them (for export and for
another engine continuing the run)."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from lavis_ds.runners import checkpoint as ckpt

CLIENT_STATE = "client_state.pt"  # the loop's state (step, scheduler, config); rank 0 writes it


def read_index(tag_dir: Path):
    """The DCP index (``.metadata``) of a checkpoint; DamagedCheckpoint if it, or a file it lists, is missing,
    unreadable or shorter than the index says."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(tag_dir)).read_metadata()
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
    import torch.distributed.checkpoint as dcp

    entries = read_index(tag_dir).state_dict_metadata  # every file there and whole, or DamagedCheckpoint naming it
    flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype) if hasattr(entry, "size") else None
            for key, entry in entries.items() if key.startswith(prefix)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, checkpoint_id=str(tag_dir), no_dist=True)
    return flat


def read_trained_weights(tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(trained weights by parameter name, in fp32; the client state)`` of a complete runner_fsdp checkpoint,
    read in one process whatever number of processes saved it (for export)."""
    weights = {key[len("model."):]: tensor.float() for key, tensor in read_everything(tag_dir, "model.").items()}
    return weights, ckpt.load_file(tag_dir / CLIENT_STATE)

