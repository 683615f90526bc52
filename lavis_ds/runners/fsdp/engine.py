"""PyTorch FSDP2 (``fully_shard``) behind the shared loop: the other ZeRO-3, without DeepSpeed.

Each repeated block (ViT block, Q-Former layer, LLM decoder layer) is a sharding unit, then
the model as a whole (embeddings, norms, heads, queries, projection). The optimizer is
torch's AdamW on the same parameter groups as DeepSpeed's, stepped by the same schedulers.
Checkpoints are ``torch.distributed.checkpoint`` folders of the trainable parameters and
their optimizer state, in the same step_<N> protocol as every engine's; a checkpoint saved
by N processes loads on M (DCP reshards).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from omegaconf import OmegaConf

from lavis_ds.common import comm
from lavis_ds.common.precision import autocast, to_compute
from lavis_ds.common import registry as reg
from lavis_ds.common.run_config import TrainingSettings, training_settings
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.engine import Engine, EngineConfig, EngineSetup, Forwarded, micro_batch_loss
from lavis_ds.runners.fsdp import checkpoint as fsdp_ckpt
from lavis_ds.runners.fsdp.checkpoint import FSDPCheckpoints
from lavis_ds.runners.handover import check_takeover, foreign_writer, report_takeover

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class FSDPOptions:
    """Schema of ``run.fsdp``."""

    # mixed: fp32 trainable parameters and optimizer states, frozen ones and compute in run.precision (as
    # DeepSpeed trains);
    # low: parameters and optimizer states kept in run.precision (half the memory, a coarser update)
    precision_mode: Literal["mixed", "low"] = "mixed"
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer states in host memory
    reshard_after_forward: bool = True  # free each block's gathered parameters after its forward (ZeRO-3); false: keep


class FSDPEngineConfig(EngineConfig):
    """``run.fsdp``, the engine's config part: its schema (``FSDPOptions``) and what runner_fsdp cannot do."""

    KEY = "fsdp"
    MODEL_NEEDS = ("shard",)  # repeated_blocks(): the units fully_shard wraps one by one

    @classmethod
    def read(cls, value):
        if isinstance(value, bool):  # LAVIS's switch, not options: lavis_compat drops false and refuses true
            return value, []
        return super().read(value)

    @classmethod
    def problems(cls, run, world_size, settings_ok):
        options, problems = run.get("fsdp") or {}, []
        if not isinstance(options, dict):
            return []  # reported when the section was read
        check_section(options, fields_of(FSDPOptions), "run.fsdp", problems, require=False)
        if settings_ok and training_settings(run, world_size).precision == "fp16":
            problems.append("run.precision: fp16 is not supported by runner_fsdp (fp16 needs a loss scaler, which "
                            "runner_fsdp does not have); use bf16, or the DeepSpeed engine")
        return problems


class FSDPSetup(EngineSetup):
    """FSDP2's model placement (the process group starts as every engine's does)."""

    @classmethod
    def model_placement(cls, cfg):
        """On several processes, process 0 alone builds and loads the LLM; the others build it on the meta
        device and receive their shards in ``wrap``."""
        from lavis_ds.common import dist
        from lavis_ds.models.llm_placement import Rank0Placement, llm_placement

        return llm_placement(Rank0Placement()) if dist.world_size() > 1 else contextlib.nullcontext()


@reg.engines.register("runner_fsdp")
class FSDPEngine(Engine):
    """``fully_shard`` modules configured by the run keys and ``run.fsdp``."""

    config = FSDPEngineConfig
    checkpoints = FSDPCheckpoints
    setup = FSDPSetup

    def __init__(self, run, model, checkpoint_dir):
        super().__init__(run, model, checkpoint_dir)
        self.options = FSDPOptions(**(run.get("fsdp") or {}))  # read before wrap too: checkpoints are checked first
        self.settings: TrainingSettings = training_settings(OmegaConf.to_container(run, resolve=True), self.world_size)
        self.dtype = DTYPES[self.settings.precision]
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))

    def wrap(self, param_groups, plan):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.plan, model = plan, self.model
        from_rank0 = built_on_rank0(model)
        if not from_rank0:
            model.to(self.device)  # fully_shard shards what is on the device (a no-op on CPU)
        # else fully_shard moves what is real to the device itself and leaves the meta parameters for the load
        low_precision = self.dtype != torch.float32
        if low_precision and self.options.precision_mode == "low":
            model.to(self.dtype)
            policy = MixedPrecisionPolicy()  # parameters already in the compute dtype
        elif low_precision:
            # Frozen weights are stored in the compute dtype, as DeepSpeed casts them: the policy would round
            # them to it at every all-gather anyway, so this changes no number and halves their memory.
            for param in model.parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(self.dtype)
            policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        # Pinned host memory speeds up copies to a GPU; without one (CPU-only torch) pinning raises.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        shard = dict(mp_policy=policy, reshard_after_forward=self.options.reshard_after_forward,
                     **({"offload_policy": offload} if self.options.cpu_offload else {}))
        # fully_shard swaps every parameter for a sharded one: remember the groups by name.
        names = {id(p): name for name, p in model.named_parameters()}
        group_names = [[names[id(p)] for p in group["params"]] for group in param_groups]
        # Process 0's whole model, in the dtypes just set; the tensors are shared, not copied.
        whole = model.state_dict() if from_rank0 and self.rank == 0 else {}
        for block in model.repeated_blocks():
            fully_shard(block, **shard)
        # The root unit (embeddings, head, what no block holds) stays gathered from its forward to its backward, as
        # torch's default has it: the backward needs it first, so resharding it would only gather it again at once.
        fully_shard(model, **{**shard, "reshard_after_forward": False})
        if from_rank0:
            _load_from_rank0(model, whole)
            del whole  # process 0 holds its shards only from here on
        sharded = dict(model.named_parameters())
        groups = [{**group, "params": [sharded[name] for name in names]} for group, names in zip(param_groups, group_names)]
        betas, eps = self.run.get("adam_betas"), self.run.get("adam_eps")
        # foreach: one dispatch per operation for all parameters, as torch chooses on a GPU; on a CPU it would loop
        # over the parameters, each DTensor operation dispatched on its own (as slow as the forward and backward of
        # the tiny test model)
        self.optimizer = torch.optim.AdamW(groups, lr=self.run.init_lr, foreach=True,
                                           **({"betas": tuple(betas)} if betas else {}),
                                           **({"eps": eps} if eps is not None else {}))
        return self.optimizer

    def checkpoint_layout(self) -> dict:
        return {"runner": "runner_fsdp", "format": "torch.distributed.checkpoint",
                "precision": self.settings.precision, "precision_mode": self.options.precision_mode}

    # ------------------------------------------------------------------ steps
    def forward(self, batch):
        with autocast(self.device, self.dtype):
            return self.model(to_compute(batch, self.device, self.dtype))  # as under DeepSpeed's bf16 engine

    def forward_backward(self, micro_batches, loss_weight):
        losses, last = [], len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            # Gradients are reduce-scattered once per optimizer step, at its last micro-batch.
            self.model.set_requires_gradient_sync(i == last)
            loss = micro_batch_loss(self.forward(batch), loss_weight)
            losses.append(loss.detach().double())  # on the device: no host sync per micro-batch
            mean_part = loss / len(micro_batches)  # the mean over micro-batches, as DeepSpeed scales it
            if i < last:
                mean_part.backward()
        # the last backward is the loop's to run, once its loss check is under way
        return Forwarded(torch.stack(losses), mean_part.backward)

    def optimizer_step(self, apply=True):
        if not apply:
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": None}
        params = [p for p in self.model.parameters() if p.grad is not None]
        # The norm of sharded gradients is a partial sum on each rank: made whole once (one all-reduce), then the
        # clip and the log both use it. (clip_grad_norm_ reduces it for its clip and returns it partial again, so
        # logging it would take a second all-reduce every step.)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if self.settings.grad_norm_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.settings.grad_norm_clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm)}

    def generate(self, batch, **kwargs):
        # generate() is not forward(): the model-level parameters (queries, embeddings, heads) are gathered
        # here; each block gathers its own. Every rank keeps stepping until all are done.
        self.model.unshard()
        try:
            with autocast(self.device, self.dtype):
                return self.model.generate(to_compute(batch, self.device, self.dtype), synced_gpus=self.world_size > 1,
                                           **kwargs)
        finally:
            self.model.reshard()

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, tag, client_state):
        import torch.distributed.checkpoint as dcp

        tag_dir = self.checkpoint_dir / tag
        try:
            dcp.save(_state(self.model, self.optimizer), checkpoint_id=str(tag_dir))
        except dcp.api.CheckpointException as e:
            # DCP wraps every rank's error (a full disk: torch's RuntimeError or an OSError) with its traceback in a
            # BaseException; the loop names a failed write once it sees the error itself.
            raise _first_failure(e) from None
        if self.rank == 0:
            torch.save(client_state, tag_dir / fsdp_ckpt.CLIENT_STATE)

    def load_checkpoint(self, load_dir, tag):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from lavis_ds.runners.fsdp import dcp_reader

        tag_dir = Path(load_dir) / tag
        if self.plan.handover_from is not None:
            return _take_over(self, self.plan.handover_from, tag_dir)
        state = _state(self.model, self.optimizer)  # the shapes and shards to read into (DCP reshards to them)
        dcp_reader.load(state, tag_dir)  # DCP's own reader would unpickle its index and entries unrestricted
        # Frozen weights are not in the checkpoint: they come from where the model loaded them.
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))
        return ckpt.load_file(tag_dir / fsdp_ckpt.CLIENT_STATE)

    def check_checkpoint(self, tag_dir, same_world):
        source = foreign_writer(self, tag_dir)
        if source is not None:
            check_takeover(self, tag_dir, source)
            return
        marker = ckpt.read_marker(tag_dir)
        saved = fsdp_ckpt.saved_shapes(fsdp_ckpt.read_index(tag_dir))
        ckpt.load_file(tag_dir / fsdp_ckpt.CLIENT_STATE, mmap=True)
        if same_world:
            ckpt.load_file(ckpt.rng_file(tag_dir, self.rank))
        problems = ckpt.trainable_problems(tag_dir, saved, self.model)
        if problems:
            raise ckpt.CheckpointError(f"{tag_dir} does not fit this model: " + "; ".join(problems))
        if marker.get("precision_mode", "mixed") != self.options.precision_mode:
            raise ckpt.CheckpointError(
                f"{tag_dir} was saved with run.fsdp.precision_mode={marker.get('precision_mode')} and this run asks "
                f"for {self.options.precision_mode}; its parameters and optimizer states are kept in another dtype. "
                f"Resume with the mode it was saved with, or start afresh (--options run.resume=false)")

    # ------------------------------------------------ switching engines
    def takeover_problem(self):
        if self.options.precision_mode == "low" and self.settings.precision != "fp32":
            return (f"with run.fsdp.precision_mode=low cannot continue it exactly (the fp32 weights and AdamW "
                    f"moments would be rounded to {self.settings.precision}); use precision_mode mixed")
        return None


# A short name, as the DeepSpeed engine has MiniGPT4Qwen's.
reg.engines.register_alias("fsdp_runner", "runner_fsdp")


def built_on_rank0(model) -> bool:
    """Whether some process built parameters on the meta device (``model_placement``): then every process
    receives its shards from process 0. Agreed by all processes, as the load is collective."""
    empty = comm.all_reduce(torch.tensor([int(any(p.is_meta for p in model.parameters()))]), op="max")
    return bool(empty.item())


def _load_from_rank0(model, whole: dict) -> None:
    """Every parameter and buffer from process 0's whole model, each process keeping its shard (torch
    broadcasts them one at a time); the meta parameters become real ones here."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise RuntimeError(f"runner_fsdp: {len(meta)} parameters received no weights from process 0, e.g. "
                           f"{', '.join(meta[:3])}")


def _state(model, optimizer) -> dict:
    """The trainable parameters' and their optimizer state's shards, as a DCP checkpoint holds them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_state, "optim": optim_state}


def _take_over(engine: FSDPEngine, source: type[Engine], tag_dir: Path) -> dict:
    """``engine`` (wrapped) continues another engine's run: its fp32 weights and Adam moments, parameter by
    parameter. Process 0 reads them whole; every other process receives its shards from it, one tensor at a time."""
    import torch.distributed as torch_dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model, optimizer, rank = engine.model, engine.optimizer, engine.rank
    several = torch_dist.is_initialized() and engine.world_size > 1
    handover = source.checkpoints.read_handover(tag_dir, engine.checkpoint_dir / "universal", rank,
                                                needed=rank == 0 or not several)
    weights, optim = {}, {}
    if handover is not None:
        groups = get_optimizer_state_dict(model, optimizer)["param_groups"]  # by parameter name
        names = [name for group in groups for name in group["params"]]
        weights = {name: handover.states[name]["fp32"] for name in names}
        optim = {"state": {name: {"step": torch.tensor(float(handover.step)),
                                  "exp_avg": handover.states[name]["exp_avg"],
                                  "exp_avg_sq": handover.states[name]["exp_avg_sq"]} for name in names},
                 "param_groups": groups}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=several, ignore_frozen_params=True,
                               strict=False)
    # One call each: set_state_dict skips the model on a process whose model dict is empty (torch 2.14), so
    # the processes' broadcasts would not pair up.
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, optim, options=options)
    client_state = comm.broadcast_object(handover.client_state if handover is not None else None)
    report_takeover(engine, tag_dir)
    return client_state


def _first_failure(error: BaseException) -> BaseException:
    """The error of the lowest failing rank inside a DCP ``CheckpointException`` (itself if it holds none)."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return error
    first = failures[min(failures)]
    return first[0] if isinstance(first, tuple) else first
