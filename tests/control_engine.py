"""A test engine for the control plane: the shared loop on several processes that exchange no data.

Each process steps torch's AdamW on its own copy of the model and saves its own state file: no
gradient, parameter or shard ever crosses processes. Everything that does cross them is lavis_ds's
own control traffic (the stop/fault agreement, the step's losses, evaluation sums, gathered
predictions, checkpoint checks and barriers), which is what the NCCL stand-in
(``LAVIS_DS_NCCL_STANDIN=1``) puts to the test: on a CPU machine the engines' data plane is CPU
tensors too, which a group refusing CPU tensors cannot carry.

Registered as ``runner_control_test``; name this module under ``imports:``. ``CONTROL_NAN_AT=<step>:<rank>``
in the environment makes that rank's loss NaN at that (1-based) optimizer step.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from lavis_ds.common.registry import registry
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.engine import Forwarded
from plain_engine import PlainEngine


@registry.register_engine("runner_control_test")
class ControlEngine(PlainEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0  # optimizer steps taken (applied or skipped), as the loop counts them

    def forward_backward(self, micro_batches, loss_weight):
        losses, last_backward = super().forward_backward(micro_batches, loss_weight)
        return Forwarded(self.poisoned(losses), last_backward)

    def poisoned(self, losses):
        """``losses`` with a NaN first, at the step and rank ``CONTROL_NAN_AT`` names (``step:rank``)."""
        step, rank = (int(x) for x in os.environ.get("CONTROL_NAN_AT", "0:-1").split(":"))
        if step == self.steps + 1 and rank == self.rank:
            losses = losses.clone()
            losses[0] = float("nan")
        return losses

    def optimizer_step(self, apply=True):
        self.steps += 1
        return super().optimizer_step(apply)

    def checkpoint_layout(self):
        return {"runner": "runner_control_test"}

    def _state_file(self, tag_dir) -> Path:
        return Path(tag_dir) / f"control_rank{self.rank}.pt"

    def save_checkpoint(self, tag, client_state):
        tag_dir = self.checkpoint_dir / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        trainable = {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}
        torch.save({"model": trainable, "optimizer": self.optimizer.state_dict(), **client_state},
                   self._state_file(tag_dir))

    def check_checkpoint(self, tag_dir, same_world):
        ckpt.read_marker(tag_dir)
        ckpt.load_file(self._state_file(tag_dir), mmap=True)

    def load_checkpoint(self, load_dir, tag):
        state = ckpt.load_file(self._state_file(Path(load_dir) / tag))
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["lavis_ds"]["train_state"]["global_step"]
        return state
