"""A user's third engine: plain torch DistributedDataParallel behind the shared loop, from a module of their own.

Registered as ``runner_ddp_test``; a run names this module under ``imports:`` and ``run.runner: runner_ddp_test``.
Every process holds the whole model and steps torch's AdamW on it; DDP averages the gradients over the processes
once per optimizer step (``no_sync`` for the micro-batches before the last). A checkpoint is one file written by
process 0 (every process holds the same weights and optimizer state), read by all.

The engine class does the training; what is read before or without an engine is held in parts
(``lavis_ds/runners/engine.py``): here only ``checkpoints``, whose ``FILES`` let a folder be recognised as this
engine's. It keeps the default ``config`` (no options section of its own).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from lavis_ds.common.registry import registry
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.engine import Engine, EngineCheckpoints, Forwarded, micro_batch_loss

STATE_FILE = "ddp.pt"


class DDPCheckpoints(EngineCheckpoints):
    FILES = (STATE_FILE,)


@registry.register_engine("runner_ddp_test")
class DDPEngine(Engine):
    checkpoints = DDPCheckpoints

    def __init__(self, run, model, checkpoint_dir):
        super().__init__(run, model, checkpoint_dir)
        self.ddp: torch.nn.Module | None = None  # wrap()'s: the model in DDP (the model itself on one process)

    def wrap(self, param_groups, plan):
        self.plan = plan
        self.ddp = DistributedDataParallel(self.model) if self.world_size > 1 else self.model
        self.optimizer = torch.optim.AdamW(param_groups, lr=self.run.init_lr)
        return self.optimizer

    def forward(self, batch):
        return self.model(batch)  # evaluation: no gradient to synchronise

    def forward_backward(self, micro_batches, loss_weight):
        losses = []
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # DDP decides in the forward whether the backward all-reduces: the last micro-batch's does
            with contextlib.nullcontext() if last or self.world_size == 1 else self.ddp.no_sync():
                loss = micro_batch_loss(self.ddp(batch), loss_weight)
                losses.append(loss.detach().double())
                mean_part = loss / len(micro_batches)  # DDP averages over processes, this over micro-batches
                if not last:
                    mean_part.backward()
        # the last backward is the loop's to run: its loss check's all-reduce travels during it
        return Forwarded(torch.stack(losses), mean_part.backward)

    def optimizer_step(self, apply=True):
        norm = None
        if apply:
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.run.grad_norm_clip or float("inf")))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm}

    def generate(self, batch, **kwargs):
        return self.model.generate(batch, **kwargs)

    def checkpoint_layout(self):
        return {"runner": "runner_ddp_test"}

    def save_checkpoint(self, tag, client_state):
        tag_dir = self.checkpoint_dir / tag
        tag_dir.mkdir(parents=True, exist_ok=True)  # every process writes its random states there too
        if self.rank == 0:
            trainable = {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}
            torch.save({"model": trainable, "optimizer": self.optimizer.state_dict(), **client_state},
                       tag_dir / STATE_FILE)

    def check_checkpoint(self, tag_dir, same_world):
        saved = ckpt.load_file(Path(tag_dir) / STATE_FILE, mmap=True)["model"]
        problems = ckpt.trainable_problems(tag_dir, {name: tuple(t.shape) for name, t in saved.items()}, self.model)
        if problems:
            raise ckpt.CheckpointError(f"{tag_dir} does not fit this model: " + "; ".join(problems))

    def load_checkpoint(self, load_dir, tag):
        state = ckpt.load_file(Path(load_dir) / tag / STATE_FILE)
        self.model.load_state_dict(state["model"], strict=False)  # frozen weights come from the model's build
        self.optimizer.load_state_dict(state["optimizer"])
        return state
