"""A test engine: the shared loop on the bare model and torch's AdamW, in one process, no process group.

It exists to show that the trainer (`runners/trainer.py`) needs no real engine, and to test the loop and its
hooks in-process, in seconds. Registered as `runner_plain_test`; name this module under `imports:`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from lavis_ds.common.registry import registry
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.engine import Engine, Forwarded, micro_batch_loss

STATE_FILE = "plain.pt"


@registry.register_engine("runner_plain_test")
class PlainEngine(Engine):
    def wrap(self, param_groups, plan):
        self.plan = plan
        self.optimizer = torch.optim.AdamW(param_groups, lr=self.run.init_lr)
        return self.optimizer

    def forward(self, batch):
        return self.model(batch)

    def forward_backward(self, micro_batches, loss_weight):
        losses = []
        for i, batch in enumerate(micro_batches):
            loss = micro_batch_loss(self.forward(batch), loss_weight)
            losses.append(loss.detach().double())
            mean_part = loss / len(micro_batches)
            if i < len(micro_batches) - 1:
                mean_part.backward()
        return Forwarded(torch.stack(losses), mean_part.backward)  # every loss known; the loop runs the last backward

    def optimizer_step(self, apply=True):
        norm = None
        if apply:
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf")))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm}

    def generate(self, batch, **kwargs):
        return self.model.generate(batch, **kwargs)

    def checkpoint_layout(self):
        return {"runner": "runner_plain_test"}

    def save_checkpoint(self, tag, client_state):
        tag_dir = self.checkpoint_dir / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        trainable = {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}
        torch.save({"model": trainable, "optimizer": self.optimizer.state_dict(), **client_state}, tag_dir / STATE_FILE)

    def check_checkpoint(self, tag_dir, same_world):
        ckpt.read_marker(tag_dir)
        ckpt.load_file(Path(tag_dir) / STATE_FILE, mmap=True)

    def load_checkpoint(self, load_dir, tag):
        state = ckpt.load_file(Path(load_dir) / tag / STATE_FILE)
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        return state
