"""The training loop every runner shares.

A runner subclass says how to wrap the model (``wrap``), run one optimizer
step (``train_step``), run a forward pass (``forward``) and save/load a
checkpoint. Everything else - data order, LR schedule, hooks, resumption - is
here, once.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import ConcatDataset, DataLoader

from lavis_ds.common import dist
from lavis_ds.common.registry import registry
from lavis_ds.common.config import ConfigError
from lavis_ds.common.run_config import batch_sizes, elastic_batch_sizes
from lavis_ds.common.seeding import SeededDataset, derive_seed, seed_everything
from lavis_ds.datasets.mixing import mix_train_splits
from lavis_ds.datasets.samplers import EvalBatchSampler, StepBatchSampler
from lavis_ds.optim import build_param_groups
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.hooks import build_hooks


@dataclass
class TrainState:
    """Where training is. Saved in every checkpoint; enough to continue exactly there."""

    epoch: int = 0
    global_step: int = 0  # optimizer steps done
    step_in_epoch: int = 0  # optimizer steps done in `epoch`


class RunnerBase:
    """Owns the loop; subclasses own the engine."""

    def __init__(self, cfg: DictConfig, model: torch.nn.Module, datasets: dict[str, dict]):
        self.cfg, self.run = cfg, cfg.run
        self.model, self.datasets = model, datasets
        self.rank, self.world_size = dist.rank(), dist.world_size()
        self.output_dir = Path(self.run.output_dir)
        self.resume_from = self.resume_source()
        self.micro_batch, self.accum, self.global_batch = self._batch_sizes()

        self.state = TrainState()
        self.train_set = None
        if self.run.train_splits:
            # sample_ratio on the sections: each epoch draws from them by ratio; else one concatenation.
            mixed = mix_train_splits(datasets, cfg.datasets, self.run.train_splits, self.run.seed)
            # Augmentation is a function of (seed, epoch, sample index): a resumed epoch repeats it exactly.
            self.train_set = SeededDataset(mixed or self._concat(self.run.train_splits), self.run.seed)
        if self.train_set is not None:
            self.sampler = StepBatchSampler(len(self.train_set), self.micro_batch, self.accum, self.world_size,
                                            self.rank, seed=self.run.seed)
            self.steps_per_epoch = self.sampler.steps_per_epoch
            self.train_loader = self._loader(self.train_set, self.sampler)
        else:
            self.steps_per_epoch = 0
        self.total_steps = self.steps_per_epoch * self.run.max_epoch

        param_groups = build_param_groups(model, self.run.weight_decay, dict(self.run.lr_scales))
        self.optimizer = self.wrap(model, param_groups)
        self.scheduler = registry.get_lr_scheduler_class(self.run.lr_sched).from_config(
            self.optimizer, self.run, total_steps=max(1, self.total_steps), steps_per_epoch=max(1, self.steps_per_epoch))
        self.hooks = build_hooks(self)

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        self.resume()
        if self.already_finished():
            return
        if self.rank == 0:  # from an earlier run in this folder (run.resume=false): not this run's
            self.finished_file.unlink(missing_ok=True)
        self.call_hooks("before_train")
        self.module.train()  # once: evaluation restores the mode it found
        for epoch in range(self.state.epoch, self.run.max_epoch):
            self.sampler.set_position(epoch, self.state.step_in_epoch)
            self.train_set.set_epoch(epoch)  # before iter(): DataLoader workers copy the dataset then
            micro_batches = iter(self.train_loader)
            for _ in range(self.state.step_in_epoch, self.steps_per_epoch):
                self.run_step([next(micro_batches) for _ in range(self.accum)])
            self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
            self.call_hooks("after_epoch")
        self.call_hooks("after_train")
        self.close()
        if self.rank == 0:  # last: a run killed during its final evaluation evaluates again when rerun
            self.finished_file.write_text(json.dumps({"global_step": self.state.global_step}))

    @property
    def finished_file(self) -> Path:
        return self.output_dir / "finished.json"

    def already_finished(self) -> bool:
        """Whether this is a rerun of a run that completed, final evaluation included; says so if it is."""
        done = (self.state.global_step >= self.total_steps and self.finished_file.is_file()
                and json.loads(self.finished_file.read_text()).get("global_step") == self.state.global_step)
        if done and self.rank == 0:
            print(f"lavis_ds: this run already finished at step {self.state.global_step} (results in "
                  f"{self.output_dir / 'metrics.jsonl'}); nothing to do. To train longer raise run.max_epoch; "
                  "to start over pass --options run.resume=false or use another run.output_dir.", flush=True)
        return done

    def run_step(self, micro_batches: list[dict]) -> None:
        """One optimizer step and everything around it: its lr, the counters, the hooks."""
        lr = self.scheduler.get_lr()
        # Dropout & co. draw from (seed, step, rank): a resumed step draws what the original one did.
        seed_everything(derive_seed(self.run.seed, self.state.global_step, self.rank))
        metrics = self.train_step(micro_batches)
        self.scheduler.step()  # once per optimizer step, never per micro-batch
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        self.call_hooks("after_step", {**metrics, "lr": lr})

    def evaluate_only(self) -> None:
        """`run.evaluate: true`: load the checkpoint named by `run.resume`, evaluate, stop."""
        self.resume()
        self.call_hooks("before_train")
        self.call_hooks("after_epoch", evaluate_only=True)
        self.call_hooks("after_train")
        self.close()

    def close(self) -> None:
        if getattr(self, "writer", None) is not None:
            self.writer.close()

    def call_hooks(self, event: str, *args, **kwargs) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self, *args, **kwargs)

    # ------------------------------------------------- what subclasses provide
    @classmethod
    def prepare_process(cls, cfg: DictConfig) -> None:
        """Once per process, before the process group starts (e.g. compile the engine's ops). Default: nothing."""

    def wrap(self, model: torch.nn.Module, param_groups: list[dict]):
        """Build the engine around ``model``; return the optimizer whose param_groups carry the lr."""
        raise NotImplementedError

    def forward(self, batch: dict) -> dict:
        raise NotImplementedError

    def checkpoint_layout(self) -> dict:
        """What the completion marker records about how the engine cut the checkpoint (runner, stage, dtype)."""
        return {}

    def train_step(self, micro_batches: list[dict]) -> dict:
        """Forward/backward every micro-batch, one optimizer step; return loss and grad_norm."""
        raise NotImplementedError

    def save_checkpoint(self, tag: str, client_state: dict) -> None:
        raise NotImplementedError

    def load_checkpoint(self, load_dir: Path, tag: str | None) -> dict:
        """Load engine state; return the client state saved with it."""
        raise NotImplementedError

    @property
    def module(self) -> torch.nn.Module:
        """The model without its wrapper (for generate and export)."""
        return self.model

    def trainable_names(self) -> list[str]:
        return [name for name, p in self.module.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------- checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def save(self) -> Path:
        """Save on every rank (DeepSpeed requires it), then mark the folder complete."""
        tag = ckpt.tag_for(self.state.global_step)
        client_state = {"lavis_ds": {"train_state": asdict(self.state), "scheduler": self.scheduler.state_dict(),
                                     "world_size": self.world_size, "config": OmegaConf.to_yaml(self.cfg)}}
        self.save_checkpoint(tag, client_state)
        tag_dir = self.checkpoint_dir / tag
        torch.save(ckpt.rng_states(), ckpt.rng_file(tag_dir, self.rank))
        dist.barrier()  # every rank has written everything before the marker says so
        if self.rank == 0:
            ckpt.mark_complete(tag_dir, {
                "global_step": self.state.global_step, "epoch": self.state.epoch,
                "world_size": self.world_size, "global_batch": self.global_batch, **self.checkpoint_layout()})
        self.call_hooks("after_save", tag_dir)  # scoring and pruning (BestCheckpoint)
        dist.barrier()
        return tag_dir

    def resume_source(self) -> tuple[Path, str | None] | None:
        """(load_dir, tag) to resume from, following run.resume / resume_ckpt_load_dir."""
        if self.run.resume_ckpt_load_dir:
            load_dir = Path(self.run.resume_ckpt_load_dir)
            tag = self.run.resume_ckpt_tag
            if tag is None and (latest := ckpt.latest_complete(load_dir)) is not None:
                tag = latest.name
            return load_dir, tag
        resume = self.run.resume
        if resume in (False, None):
            return None
        if resume == "auto":
            latest = ckpt.latest_complete(self.checkpoint_dir)
            return (latest.parent, latest.name) if latest else None
        path = Path(resume)
        if ckpt.is_complete(path):
            return path.parent, path.name
        latest = ckpt.latest_complete(path)
        if latest is None:
            raise FileNotFoundError(f"run.resume: {path} holds no complete lavis_ds checkpoint "
                                    f"(a step_<N> folder with {ckpt.COMPLETE_MARKER})")
        return latest.parent, latest.name

    def _batch_sizes(self) -> tuple[int, int, int]:
        """The config's batch sizes; resuming on another number of processes keeps the saved global batch."""
        micro, accum, total = batch_sizes(OmegaConf.to_container(self.run), self.world_size)
        saved = self.saved_layout()
        self.elastic = saved is not None and saved["world_size"] != self.world_size
        if not self.elastic:
            return micro, accum, total
        where = f"resuming {self.resume_from[0] / self.resume_from[1]} (saved by {saved['world_size']} processes)"
        try:
            return elastic_batch_sizes(micro, saved["global_batch"], self.world_size, where)
        except ValueError as e:
            raise ConfigError([str(e)], str(self.resume_from[0])) from None

    def saved_layout(self) -> dict | None:
        """World size and global batch of the checkpoint to resume from (None: fresh start or unknown)."""
        if self.resume_from is None or self.resume_from[1] is None:
            return None
        info = ckpt.read_marker(self.resume_from[0] / self.resume_from[1])
        return info if "world_size" in info else None

    def resume(self) -> None:
        source = self.resume_from
        if source is None:
            seed_everything(self.run.seed + self.rank)
            return
        load_dir, tag = source
        if self.rank == 0:
            # A save the kill interrupted: its steps come again, and its folder must not hold stale files.
            for torn in ckpt.discard_incomplete(self.checkpoint_dir):
                print(f"discarded the incomplete checkpoint {torn}", flush=True)
        dist.barrier()
        client = self.load_checkpoint(load_dir, tag)["lavis_ds"]
        self.state = TrainState(**client["train_state"])
        self.scheduler.load_state_dict(client["scheduler"])
        rng = ckpt.rng_file(load_dir / (tag or ""), self.rank)
        if tag and client.get("world_size") == self.world_size and rng.is_file():
            ckpt.restore_rng_states(torch.load(rng, weights_only=False))
        else:
            seed_everything(self.run.seed + self.rank + self.state.global_step)
        if self.rank == 0:
            print(f"resumed from {load_dir / (tag or '')} at epoch {self.state.epoch}, "
                  f"step {self.state.global_step} ({self.state.step_in_epoch} into the epoch), "
                  f"lr {self.scheduler.get_lr():.3e}", flush=True)

    # -------------------------------------------------------------- evaluation
    def _eval_batches(self, split: str):
        """Yield ``(dataset, indices, batch, is_padding)`` for this rank's shard of a split, in eval mode.

        Every rank runs the same number of batches (ZeRO-3 forwards are collective);
        padding batches are flagged: run them, discard their results. ``indices`` index ``dataset``
        (not ``batch["index"]``, which is per part of a ConcatDataset).
        """
        dataset = self._concat([split])
        sampler = EvalBatchSampler(len(dataset), self.run.batch_size_eval, self.world_size, self.rank)
        was_training = self.module.training
        self.module.eval()
        try:
            for i, (indices, batch) in enumerate(zip(sampler, self._loader(dataset, sampler))):
                yield dataset, indices, batch, sampler.is_padding(i)
        finally:
            self.module.train(was_training)

    @torch.no_grad()
    def evaluate_loss(self, split: str) -> dict:
        """Token-weighted mean loss over a split, on all ranks."""
        totals = torch.zeros(2, dtype=torch.float64)
        for _, _, batch, padding in self._eval_batches(split):
            out = self.forward(batch)
            if not padding:
                totals += torch.tensor([float(out["loss_sum"]), float(out["num_tokens"])], dtype=torch.float64)
        if torch_dist.is_initialized():
            torch_dist.all_reduce(totals)
        return {"loss": (totals[0] / totals[1].clamp(min=1)).item(), "num_tokens": int(totals[1])}

    @torch.no_grad()
    def generate_split(self, split: str) -> list[dict]:
        """Generate an answer for every sample of a split; the full list on every rank, in index order.

        Each result: ``index``, ``dataset`` (its section), ``image``, ``prompt`` (the last instruction),
        ``references`` (every acceptable answer), ``expected`` (the first) and ``generated``.
        """
        kwargs = {"max_new_tokens": 30, "num_beams": 1, **dict(self.run.generate)}
        sections = [name for name, per_split in self.datasets.items() if split in per_split]  # _concat's order
        mine = []
        for dataset, indices, batch, padding in self._eval_batches(split):
            texts = self.generate(batch, **kwargs)
            if padding:
                continue
            references = batch.get("references") or [output[-1:] for output in batch["output"]]
            for index, text, instruction, refs in zip(indices, texts, batch["instruction"], references, strict=True):
                number, part, local = _part_of(dataset, index)
                image_of = getattr(part, "image_name", None)  # None if the dataset cannot say
                mine.append({"index": index, "dataset": sections[number],
                             "image": image_of(local) if image_of else None, "prompt": instruction[-1],
                             "references": list(refs), "expected": refs[0], "generated": text})
        gathered = [mine]
        if torch_dist.is_initialized() and self.world_size > 1:
            gathered = [None] * self.world_size
            torch_dist.all_gather_object(gathered, mine)
        return sorted((r for part in gathered for r in part), key=lambda r: r["index"])

    def generate(self, batch: dict, **kwargs) -> list[str]:
        raise NotImplementedError

    # -------------------------------------------------------------------- data
    def _concat(self, splits) -> torch.utils.data.Dataset:
        parts = [per_split[s] for per_split in self.datasets.values() for s in splits if s in per_split]
        if not parts:
            raise ValueError(f"no dataset has split(s) {list(splits)}")
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)

    def _loader(self, dataset, batch_sampler) -> DataLoader:
        first = dataset.dataset if isinstance(dataset, SeededDataset) else dataset
        first = first.datasets[0] if isinstance(first, ConcatDataset) else first
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=first.collater,
                          num_workers=self.run.num_workers, persistent_workers=False)


def _part_of(dataset, index: int) -> tuple[int, torch.utils.data.Dataset, int]:
    """(number of the part, the part, the index inside it) of a ConcatDataset's sample; (0, dataset, index) else."""
    if not isinstance(dataset, ConcatDataset):
        return 0, dataset, index
    d = bisect.bisect_right(dataset.cumulative_sizes, index)
    return d, dataset.datasets[d], index - (dataset.cumulative_sizes[d - 1] if d else 0)
