"""runner_fsdp: PyTorch FSDP2 behind the shared loop, and everything only it needs.

``runner`` (the engine: ``fully_shard`` units, torch AdamW, saving and loading DCP checkpoints, continuing
another engine's run) and ``checkpoint`` (its checkpoint files read in one process: the index checked, the
saved shapes, every tensor whole for export and for another engine).
"""
from lavis_ds.runners.fsdp.runner import FSDPRunner

__all__ = ["FSDPRunner"]
