"""runner_fsdp: the PyTorch FSDP2 engine behind the shared loop, and everything only it needs.

``engine`` (the engine: ``fully_shard`` units, torch AdamW, saving and loading DCP checkpoints, continuing
another engine's run; and its config part, ``run.fsdp``) and ``checkpoint`` (its checkpoint files read in one
process: the index checked, the saved shapes, every tensor whole for export and for another engine: the engine's
checkpoints part).
"""
from lavis_ds.runners.fsdp.engine import FSDPEngine

__all__ = ["FSDPEngine"]
