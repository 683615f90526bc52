"""The DeepSpeed ZeRO engine (stages 0-3, CPU offload, bf16/fp16/fp32) behind the shared loop."""
from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch
import torch.distributed as torch_dist

from lavis_ds.common import comm
from lavis_ds.common.device import bind_local_device
from lavis_ds.common.errors import ConfigError, InputError
from lavis_ds.common.precision import autocast, to_compute
from lavis_ds.common import registry as reg
from lavis_ds.common.run_config import ZERO_KEYS, with_batch_layout
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.deepspeed import checkpoint as ds_ckpt
from lavis_ds.runners.deepspeed import section, zero_keys
from lavis_ds.runners.deepspeed.adam_counter import replay_step_counter
from lavis_ds.runners.deepspeed.checkpoint import DeepSpeedCheckpoints, layout_of
from lavis_ds.runners.deepspeed.library import load_deepspeed
from lavis_ds.runners.deepspeed.ops import adam_for_this_machine
from lavis_ds.runners.deepspeed.placement import gathered_root, is_partitioned, zero3_construction
from lavis_ds.runners.deepspeed.section import build_deepspeed_config
from lavis_ds.runners.engine import Engine, EngineConfig, EngineSetup, Forwarded, micro_batch_loss
from lavis_ds.runners.handover import check_takeover, foreign_writer, report_takeover


class DeepSpeedEngineConfig(EngineConfig):
    """``run.deepspeed_config``, the engine's config part (``section`` does the work)."""

    KEY = "deepspeed_config"  # the DeepSpeed JSON, inline or as the path of a .json file
    OWN_RUN_KEYS = ZERO_KEYS  # run.zero_stage, run.offload_optimizer, run.offload_params

    @classmethod
    def read(cls, value):
        return section.read_section(value)

    @classmethod
    def twins(cls, options):
        return section.option_twins(options)

    @classmethod
    def problems(cls, run, world_size, settings_ok):
        if not isinstance(run.get("deepspeed_config") or {}, dict):
            return []  # reported when the file was read
        ds, _ = section.resolve_auto(run.get("deepspeed_config") or {}, run)
        problems = section.deepspeed_problems(ds, run)
        if not problems and settings_ok:  # DeepSpeed's own models would repeat them less clearly
            # Checked as it will be handed to DeepSpeed (batch layout and optimizer completed).
            problems += section.schema_problems(build_deepspeed_config({**run, "deepspeed_config": ds}, world_size))
        return problems

    @classmethod
    def complete(cls, run, world_size):
        # What DeepSpeed will be handed ("auto" values filled, batch layout and precision completed).
        ds, notes = section.resolve_auto(run.get("deepspeed_config") or {}, run)
        run = {**run, "deepspeed_config": build_deepspeed_config({**run, "deepspeed_config": ds}, world_size)}
        return run, notes + zero_keys.no_effect_warnings(run["deepspeed_config"], run)


class DeepSpeedSetup(EngineSetup):
    """DeepSpeed's process start: its CPU ops compiled first, its own process-group start, and ZeRO-3's
    partitioned build."""

    @classmethod
    def prepare_process(cls, cfg):
        from lavis_ds.runners.deepspeed.ops import ensure_built, gpu_problems, make_arch_list_readable, ops_for

        announce = os.environ.get("LOCAL_RANK", "0") == "0"
        if torch.cuda.is_available():  # DeepSpeed JIT-builds its CUDA ops (FusedAdam) in deepspeed.initialize
            make_arch_list_readable(announce)
        # Before the process group: initialising it loads the shared-memory op on a CPU machine.
        ensure_built(ops_for(dict(cfg.run.deepspeed_config)), announce=announce)
        problems = gpu_problems(dict(cfg.run.deepspeed_config), on_gpu=torch.cuda.is_available(),
                                where=zero_keys.spelled(cfg.run, "offload_optimizer"))
        if problems:
            raise ConfigError(problems, "run.deepspeed_config")

    @classmethod
    def init_process_group(cls):
        deepspeed = load_deepspeed()

        from lavis_ds.common import dist

        dist.set_single_process_defaults()
        bind_local_device()  # before DeepSpeed allocates anything on a GPU
        if os.environ.get(comm.STANDIN_ENV) == "1":
            comm.init_process_group()  # the NCCL stand-in: DeepSpeed's start below finds the group made
        if not torch_dist.is_initialized():  # DeepSpeed's own start: on CPU it also loads its shared-memory op
            deepspeed.init_distributed(verbose=False)
        comm.start()

    @classmethod
    def model_placement(cls, cfg):
        """ZeRO-3 builds the LLM partitioned from the start (transformers' zero.Init integration); other
        stages hold whole parameters anyway, so the model is built whole."""
        from omegaconf import OmegaConf

        from lavis_ds.common import dist

        ds_config = build_deepspeed_config(OmegaConf.to_container(cfg.run, resolve=True), dist.world_size())
        if layout_of(ds_config)["zero_stage"] != 3:
            return contextlib.nullcontext()
        return zero3_construction(ds_config)


@reg.engines.register("runner_deepspeed")
class DeepSpeedEngine(Engine):
    """A `deepspeed.initialize` engine configured by `run.deepspeed_config`."""

    config = DeepSpeedEngineConfig
    checkpoints = DeepSpeedCheckpoints
    setup = DeepSpeedSetup

    def __init__(self, run, model, checkpoint_dir):
        super().__init__(run, model, checkpoint_dir)
        self.layout = layout_of(run.deepspeed_config)  # ZeRO stage and precision this run asks for
        self.ds_engine = None  # wrap()'s: DeepSpeed's own engine (deepspeed.initialize) around the model
        self.dtype = torch.float32  # wrap()'s: the engine's compute dtype
        self.universal = False  # wrap()'s: the checkpoint to resume loads through DeepSpeed's universal form

    def wrap(self, param_groups, plan):
        # Imported here, not at the top: `import lavis_ds` registers this engine, and loading an
        # exported model for inference (lavis_ds.apps.export) must not need DeepSpeed.
        deepspeed = load_deepspeed()
        from omegaconf import OmegaConf

        _check_precision_supported(self.layout["precision"])  # after the checks of the checkpoint to resume
        self.plan = plan
        run = OmegaConf.to_container(self.run, resolve=True)
        # The batch layout of the plan (a resume on another world size changes the accumulation).
        ds_config = build_deepspeed_config(with_batch_layout(run, plan.micro_batch, plan.accum, plan.global_batch),
                                           self.world_size)
        # Partitioned optimizer states are re-split from DeepSpeed's universal checkpoint format when the
        # checkpoint was cut into other pieces: another number of processes, another ZeRO stage or precision
        # (check_checkpoint has refused the changes that cannot convert), or another engine's checkpoint.
        self.universal = (plan.elastic or plan.handover_from is not None or
                          _layout_changed(plan.tag_dir, self.layout, announce=self.rank == 0))
        if self.universal:
            ds_config.setdefault("checkpoint", {})["load_universal"] = True
        ds_config, note = adam_for_this_machine(ds_config, on_gpu=torch.cuda.is_available())
        if note and self.rank == 0:
            print(note, flush=True)
        _place_unpartitioned(self.model, layout_of(ds_config)["precision"], bind_local_device())
        self.ds_engine, optimizer, _, _ = deepspeed.initialize(model=self.model, model_parameters=param_groups,
                                                               config=ds_config)
        self.dtype = (torch.bfloat16 if self.ds_engine.bfloat16_enabled() else
                      torch.float16 if self.ds_engine.fp16_enabled() else torch.float32)
        # DeepSpeed's exclude_frozen_parameters walks named_parameters(), which names a tied weight once:
        # the other name (lm_head.weight of a tied Qwen2.5-0.5B/1.5B/3B) kept the frozen embedding matrix
        # in every checkpoint. This drops every name of every frozen parameter.
        self.ds_engine.module_state_dict = functools.partial(_without_frozen, self.ds_engine.module_state_dict,
                                                             self.model)
        self.optimizer = optimizer
        return optimizer

    def checkpoint_layout(self) -> dict:
        return {"runner": "runner_deepspeed", **self.layout}

    @property
    def module(self):
        return self.ds_engine.module

    def forward(self, batch):
        with autocast(self.ds_engine.device, self.dtype):  # bf16/fp16 engines hold a cast module
            return self.ds_engine(to_compute(batch, self.ds_engine.device, self.dtype))

    def forward_backward(self, micro_batches, loss_weight):
        losses, last = [], len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            loss = micro_batch_loss(self.forward(batch), loss_weight)
            losses.append(loss.detach().double())  # on the device: no host sync per micro-batch
            if i < last:
                self.ds_engine.backward(loss)  # scaled by 1/accumulation inside DeepSpeed
                self.ds_engine.step()  # not a boundary: DeepSpeed's micro-step bookkeeping only
        # the last backward is the loop's to run, once its loss check is under way (optimizer_step is the boundary)
        return Forwarded(torch.stack(losses), functools.partial(self.ds_engine.backward, loss))

    def optimizer_step(self, apply=True):
        # ZeRO-0 in fp32 steps a plain torch optimizer, which does not report the gradient norm:
        # the gradients are all-reduced now and zeroed by step().
        plain_optimizer = self.ds_engine.zero_optimization_stage() == 0 and self.dtype == torch.float32
        grad_norm = _grad_norm(self.ds_engine.module) if plain_optimizer and apply else None
        with contextlib.nullcontext() if apply else _without_update(self.ds_engine.basic_optimizer):
            self.ds_engine.step()  # the accumulation boundary
        if not apply:
            return {"grad_norm": None}
        if not self.ds_engine.was_step_applied():  # fp16's loss scaler found inf/nan gradients and lowered the scale
            return {"grad_norm": None, "skipped": "overflow"}
        if grad_norm is None:
            grad_norm = self.ds_engine.get_global_grad_norm()
        return {"grad_norm": float(grad_norm) if grad_norm is not None else None}

    def generate(self, batch, **kwargs):
        # Under ZeRO-3 every rank must join every forward until all are done.
        synced = self.ds_engine.zero_optimization_stage() == 3 and self.world_size > 1
        with autocast(self.ds_engine.device, self.dtype), gathered_root(self.ds_engine.module):
            return self.ds_engine.module.generate(to_compute(batch, self.ds_engine.device, self.dtype),
                                                  synced_gpus=synced, **kwargs)

    def save_checkpoint(self, tag, client_state):
        self.ds_engine.save_checkpoint(str(self.checkpoint_dir), tag=tag, client_state=client_state,
                                    exclude_frozen_parameters=True)

    def check_checkpoint(self, tag_dir, same_world):
        source = foreign_writer(self, tag_dir)
        if source is not None:
            check_takeover(self, tag_dir, source)
            return
        stage = self.layout["zero_stage"]
        files = ds_ckpt.files_of_rank(tag_dir, self.rank, same_world)
        # Optimizer partitions: each rank its own, or rank 0 all of them for an elastic resume.
        ds_ckpt.check_files(files, stage if same_world or self.rank == 0 else 0)
        states = ds_ckpt.load_file(files[0], mmap=True)  # the index and pickle only, not the tensors
        saved, now = layout_of(states.get("ds_config") or {}), self.layout
        # Stages 1-3 and fp32/bf16 convert through the universal checkpoint (wrap); ZeRO-0 keeps no
        # partitioned optimizer files to convert, and fp16's loss-scaler state has no fp32/bf16 twin.
        if saved != now and ({saved["zero_stage"], now["zero_stage"]} & {0} or
                             "fp16" in {saved["precision"], now["precision"]}):
            raise ckpt.CheckpointError(
                f"{tag_dir} was saved with ZeRO stage {saved['zero_stage']} in {saved['precision']} and this run "
                f"asks for stage {now['zero_stage']} in {now['precision']}. Resuming converts between ZeRO stages "
                f"1-3 and between fp32 and bf16 only; resume with the settings it was saved with "
                f"(run.zero_stage={saved['zero_stage']}, run.precision={saved['precision']}), or "
                f"start afresh (--options run.resume=false, or another run.output_dir)")
        problems = ckpt.trainable_problems(tag_dir, ds_ckpt.saved_trainable(states), self.model)
        if problems:
            raise ckpt.CheckpointError(f"{tag_dir} does not fit this model: " + "; ".join(problems))

    def load_checkpoint(self, load_dir: Path, tag):
        tag_dir, scratch, source = Path(load_dir) / tag, self.checkpoint_dir / "universal", self.plan.handover_from
        if source is not None:  # another engine's: its per-parameter state, written as a universal copy
            handover = source.checkpoints.read_handover(tag_dir, scratch, self.rank, needed=self.rank == 0)
            load_dir = ds_ckpt.universal_copy(tag_dir, scratch, self.rank,
                                              write=functools.partial(_write_handover, self, handover))
        elif self.universal:
            load_dir = ds_ckpt.universal_copy(tag_dir, scratch, self.rank)
        hyper = _hyper_parameters(self.ds_engine.optimizer)
        # Frozen weights are not in the checkpoint (check_checkpoint made sure everything trainable is);
        # they come from where the model loaded them.
        # check_checkpoint read every file of this rank without running code; DeepSpeed's loader reads them again
        # (and a universal copy's) unrestricted, which library_reads overrides.
        with ds_ckpt.library_reads(Path(load_dir) / tag):
            path, client_state = self.ds_engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=False)
        if path is None:
            raise ckpt.CheckpointError(f"DeepSpeed found no checkpoint in {load_dir} (tag {tag!r})")
        if self.universal:
            # ZeRO-3's universal load gives every param group the first group's hyper-parameters (DeepSpeed
            # 0.19.8): biases and norms would be weight-decayed, lr_scales lost. They are the run's own.
            for group, own in zip(self.ds_engine.optimizer.param_groups, hyper):
                group.update(own)
            # Only this load needs it; the next save is in this world size. Remade if a kill comes first.
            comm.barrier()
            if self.rank == 0:
                ds_ckpt.remove_universal_copy(Path(load_dir) / tag)
        replay_step_counter(self.ds_engine.basic_optimizer)  # CPU Adam's beta powers, as an unbroken run has them
        if source is not None:
            report_takeover(self, tag_dir)
        return client_state

    # ------------------------------------------------ switching engines
    def takeover_problem(self):
        stage, precision = self.layout["zero_stage"], self.layout["precision"]
        if stage == 0:
            return ("with ZeRO stage 0 cannot continue it (stage 0 loads no per-parameter optimizer states); use "
                    "run.zero_stage 1, 2 or 3")
        if precision == "fp16":
            return ("in fp16 cannot continue it exactly (fp16's loss scaler has no state in another engine's "
                    "checkpoint); use run.precision fp32 or bf16")
        return None


def _write_handover(engine: DeepSpeedEngine, handover: ckpt.Handover, folder: Path) -> None:
    """Another engine's checkpoint as DeepSpeed's universal checkpoint (rank 0), for ``engine`` (wrapped) to load."""
    model_states = {
        # What DeepSpeed's own save records and its load reads back (a universal load takes no weights from it).
        "param_shapes": engine.ds_engine._get_zero_param_shapes(), "buffer_names": [], "mp_world_size": 1,
        "dp_world_size": handover.client_state["lavis_ds"].get("world_size", engine.world_size),
        "global_steps": handover.step, "global_samples": handover.step * engine.plan.global_batch,
        "skipped_steps": 0}
    # This engine's own hyper-parameters: a universal load sets them from the file.
    ds_ckpt.write_universal(folder, handover, model_states, _hyper_parameters(engine.ds_engine.optimizer))


def _layout_changed(tag_dir: Path | None, now: dict, announce: bool) -> bool:
    """Whether the checkpoint to resume has another ZeRO stage or precision than ``now`` (this run's; and say so)."""
    if tag_dir is None:
        return False
    saved = ds_ckpt.saved_layout(tag_dir)
    changed = [f"{key} {saved[key]} -> {now[key]}" for key in now if saved[key] != now[key]]
    if changed and announce:
        print(f"resuming through DeepSpeed's universal checkpoint: {' and '.join(changed)}", flush=True)
    return bool(changed)


def _grad_norm(module: torch.nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


@contextlib.contextmanager
def _without_update(optimizer):
    """DeepSpeed steps as usual (reductions, clearing the gradients, its counters), but ``optimizer``, the torch
    optimizer inside every ZeRO/precision wrapper, changes nothing: no weight, no Adam moment, no step count."""
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del optimizer.step


def _hyper_parameters(optimizer) -> list[dict]:
    """Each optimizer param group's settings (lr, weight decay, lr_scale, betas, ...) without its tensors."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


# MiniGPT4Qwen's name for its DeepSpeed engine (Coobiw/MPP-LLaVA: `runner: deepspeed_runner`).
reg.engines.register_alias("deepspeed_runner", "runner_deepspeed")


def _check_precision_supported(precision: str) -> None:
    """An InputError if this machine's accelerator cannot train in ``precision`` (DeepSpeed's own check raises a
    bare ``ValueError: Type fp16 is not supported on your device.`` from deepspeed.initialize)."""
    load_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}.get(precision)
    if supported is None or supported():
        return
    other = "bf16" if precision == "fp16" else "fp32"
    device = accelerator.device_name()
    why = " (torch's oneDNN has no fp16 kernels for this CPU)" if device == "cpu" and precision == "fp16" else ""
    error = InputError(
        f"run.precision: {precision} is not supported on this machine's {device} device{why}, so DeepSpeed cannot "
        f"train in it here. Train in {other} or fp32: run.precision={other}, or in a DeepSpeed section "
        f"{precision}.enabled: false and {other}.enabled: true. (A LAVIS YAML's `amp: True` means fp16; "
        f"MiniGPT4Qwen's say the dtype with `autocast_dtype: bf16`.)")
    error.quiet = int(os.environ.get("RANK", 0)) != 0  # every rank finds the same; one says it
    raise error


def _place_unpartitioned(model: torch.nn.Module, precision: str, device: torch.device) -> None:
    """Put what zero.Init did not build on ``device`` in the bf16/fp16 engine's dtype, as DeepSpeed does for a
    whole model.

    DeepSpeed neither moves nor casts a model that has some ZeRO-3 partitioned parameters (it expects zero.Init to
    have built all of them on the device, in its dtype). The ViT, Q-Former, projection, LoRA adapters and token rows
    built beside a partitioned LLM would stay fp32, and their buffers on the host: DeepSpeed moves parameters to the
    GPU as it partitions them, buffers never (EVA's zero k-bias then met CUDA tensors in its first block).
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    params = list(model.parameters())
    if not is_partitioned(params):
        return
    for param in params:
        if not is_partitioned([param]):
            floating = dtype is not None and param.is_floating_point()
            param.data = param.data.to(device, dtype if floating else None)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                module._buffers[name] = buffer.to(device)  # their dtype stays (fp32 rotary inv_freq, as DeepSpeed)


def _without_frozen(module_state_dict, model, *args, exclude_frozen_parameters: bool = False, **kwargs) -> dict:
    """The engine's ``module_state_dict``, with every name of a frozen parameter left out when asked."""
    state = module_state_dict(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
    if exclude_frozen_parameters:
        for name, param in model.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                state.pop(name, None)
    return state
