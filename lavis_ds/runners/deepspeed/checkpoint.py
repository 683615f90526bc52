"""DeepSpeed's checkpoint folders: which files a rank reads, how a checkpoint is cut, its trained weights, and
DeepSpeed's universal (world-size independent) form, through which a checkpoint changes its number of
processes, its ZeRO stage or precision, or its engine. ``DeepSpeedCheckpoints`` is the engine's checkpoints part
(``runners/engine.py``): its files read without an engine, for export and for another engine continuing the run.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig
from torch import nn

from lavis_ds.common import comm, safe_files
from lavis_ds.runners import checkpoint as ckpt
from lavis_ds.runners.deepspeed.library import load_deepspeed
from lavis_ds.runners.engine import EngineCheckpoints


@functools.cache
def deepspeed_classes() -> tuple:
    """The classes DeepSpeed pickles into its checkpoint files (optimizer states: the ZeRO stage as an enum, the loss
    scaler, the fp32 partitions' fragment addresses), allowed by name when they are read: plain data, whose
    unpickling sets attributes and runs nothing else."""
    load_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaleConfig, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return ZeroStageEnum, LossScaler, DynamicLossScaler, LossScaleConfig, fragment_address


def load_file(path: Path, mmap: bool = False) -> dict:
    """A DeepSpeed checkpoint file, read without running code (``ckpt.load_file`` with DeepSpeed's classes)."""
    return ckpt.load_file(path, mmap=mmap, allowed=deepspeed_classes())


def library_reads(folder: Path):
    """DeepSpeed's own loaders (``engine.load_checkpoint``, ``zero_to_fp32``, ``ds_to_universal``) read every file
    with an unrestricted ``torch.load``: inside this block torch restricts them as ``load_file`` is restricted."""
    return safe_files.library_reads(folder, deepspeed_classes())


def layout_of(ds_config) -> dict:
    """How a DeepSpeed checkpoint is cut: its ZeRO stage and training precision (from a dict or DictConfig)."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    bf16 = (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled", False)
    fp16 = (ds_config.get("fp16") or {}).get("enabled", False)
    return {"zero_stage": int(stage), "precision": "bf16" if bf16 else "fp16" if fp16 else "fp32"}


def saved_layout(tag_dir: Path) -> dict:
    """The ZeRO stage and precision a checkpoint was saved with, from the DeepSpeed config it recorded."""
    states = load_file(model_states_file(tag_dir), mmap=True)  # the pickle only, not the tensors
    return layout_of(states.get("ds_config") or {})


def model_states_file(tag_dir: Path) -> Path:
    """The DeepSpeed file holding the module state dict (ZeRO-3 names it per data-parallel rank)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (Path(tag_dir) / name).is_file():
            return Path(tag_dir) / name
    raise ckpt.DamagedCheckpoint(f"{tag_dir}: no DeepSpeed model states file (mp_rank_00_model_states.pt); "
                            "is this a DeepSpeed checkpoint folder?")


def files_of_rank(tag_dir: Path, rank: int, same_world: bool) -> list[Path]:
    """The files ``rank`` reads to resume from ``tag_dir``.

    Every rank reads the model states; each its own optimizer partition and RNG
    states, unless the world size changed: then rank 0 converts every partition.
    """
    tag_dir = Path(tag_dir)
    files = sorted(tag_dir.glob("*model_states.pt")) or [model_states_file(tag_dir)]
    optim = sorted(tag_dir.glob("*optim_states.pt"))
    if same_world:
        optim = [f for f in optim if f"zero_pp_rank_{rank}_" in f.name]
        return files + optim + [ckpt.rng_file(tag_dir, rank)]
    return files + (optim if rank == 0 else [])


def check_files(files: list[Path], zero_stage: int) -> None:
    """Raise DamagedCheckpoint naming the first of ``files`` that is missing or does not load."""
    for path in files:
        load_file(path, mmap=True)
    if zero_stage > 0 and not any(f.name.endswith("optim_states.pt") for f in files if f.is_file()):
        folder = files[0].parent
        raise ckpt.DamagedCheckpoint(f"{folder}: the optimizer states of this rank (*zero_pp_rank_*_optim_states.pt) "
                                f"are missing; ZeRO-{zero_stage} keeps them in one file per rank")


def saved_trainable(states: dict) -> dict[str, tuple]:
    """Names and shapes of the parameters that trained when the checkpoint was saved."""
    if states.get("param_shapes"):  # ZeRO 1-3: the optimizer's parameters
        return {name: tuple(shape) for group in states["param_shapes"] for name, shape in group.items()}
    buffers = set(states.get("buffer_names") or ())  # ZeRO-0: the module was saved without frozen parameters
    return {name: tuple(t.shape) for name, t in (states.get("module") or {}).items() if name not in buffers}


def read_trained_weights(tag_dir: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """``(trained fp32 weights by parameter name, client state, layout)`` of a complete DeepSpeed checkpoint.

    Stages 1-3 go through DeepSpeed's own consolidation (``deepspeed.utils.zero_to_fp32``), which reads the
    fp32 master partitions of every rank (``*zero_pp_rank_*_optim_states.pt``, including the ``bf16_zero_pp_*``
    files of DeepSpeed's BF16 optimizer). Stage 0 keeps everything in ``mp_rank_00_model_states.pt``: in fp32
    the module's weights are the trained values (a plain torch optimizer steps them); in bf16/fp16 the module
    holds a rounded copy and the fp32 masters sit in the FP16 optimizer's flat groups, split back by name here.
    """
    load_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # Every file whole and safe before DeepSpeed's consolidation reads them: an error names the file, not only
    # "PytorchStreamReader failed". Rank 0's model states carry the client state.
    for path in sorted(tag_dir.glob("*.pt")):
        load_file(path, mmap=True)
    states = load_file(model_states_file(tag_dir))
    layout = layout_of(states.get("ds_config") or {})
    if layout["zero_stage"] == 0:
        return _stage0_weights(states, ckpt.saved_config(tag_dir, states).run, tag_dir), states, layout
    # Stages 1-3: DeepSpeed merges the fp32 partitions of every rank. Its result also holds buffers
    # and tied aliases; `param_shapes` lists the optimizer's parameters, i.e. exactly what trained.
    with library_reads(tag_dir):
        merged = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag_dir.name,
                                                          exclude_frozen_parameters=True)
    names = [name for group in states["param_shapes"] for name in group]
    return {name: merged[name] for name in names}, states, layout


class _SavedParameters:
    """Names and shapes of saved parameters, as ``build_param_groups`` reads a model (meta tensors: no memory)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.params = {name: nn.Parameter(torch.empty(t.shape, device="meta")) for name, t in tensors.items()}

    def named_parameters(self):
        return iter(self.params.items())


def _stage0_weights(states: dict, run: DictConfig, tag_dir: Path) -> dict[str, torch.Tensor]:
    from lavis_ds.optim import build_param_groups

    buffers = set(states.get("buffer_names") or ())
    # The module was saved with exclude_frozen_parameters: what is left besides buffers trained.
    module = _first_name_per_tensor({k: v for k, v in states["module"].items() if k not in buffers})
    optimizer = states.get("optimizer") or {}
    if "fp32_groups_flat" not in optimizer:
        return {name: t.float() for name, t in module.items()}  # fp32: a torch optimizer stepped these

    # bf16/fp16: FP16_Optimizer flattened each param group (in group order, no padding) into one fp32
    # master. The groups are the trainer's, so the same function, on the same names in the same
    # order, gives the same groups.
    saved = _SavedParameters(module)
    groups = build_param_groups(saved, run.weight_decay, dict(run.lr_scales))
    name_of = {id(p): name for name, p in saved.params.items()}
    flats = optimizer["fp32_groups_flat"]
    sizes = [sum(p.numel() for p in g["params"]) for g in groups]
    if len(flats) != len(groups) or [f.numel() for f in flats] != sizes:
        raise ckpt.CheckpointError(f"{tag_dir}: the fp32 master groups ({[f.numel() for f in flats]} elements) do not match "
                          f"the parameter groups of the saved weights ({sizes}); were run.weight_decay or "
                          "run.lr_scales changed in the saved config?")
    weights = {}
    for group, flat in zip(groups, flats):
        offset = 0
        for p in group["params"]:
            weights[name_of[id(p)]] = flat[offset:offset + p.numel()].view(p.shape).float()
            offset += p.numel()
    # The module copy is the master rounded to the engine's dtype: a wrong split cannot pass this.
    wrong = [name for name, w in weights.items() if not torch.equal(w.to(module[name].dtype), module[name])]
    if wrong:
        raise ckpt.CheckpointError(f"{tag_dir}: the fp32 master weights do not round to the saved module weights for "
                          f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; the flat master groups "
                          "could not be matched to parameter names")
    return {name: weights[name] for name in module}


def _first_name_per_tensor(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names of the same tensor (tied weights), as ``named_parameters()`` does.

    torch.load keeps shared storage shared, and a state dict lists parameters in
    ``named_parameters`` order, so the name kept is the one the model's parameter has.
    """
    seen, unique = set(), {}
    for name, t in tensors.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        unique[name] = t
    return unique


def universal_copy(tag_dir: Path, universal_root: Path, rank: int,
                   write: Callable[[Path], None] | None = None) -> Path:
    """DeepSpeed's universal (world-size independent) form of ``tag_dir``; returns its load dir.

    ``write(folder)`` makes it (default: DeepSpeed's ``ds_to_universal`` of a DeepSpeed checkpoint).
    Made afresh for every elastic resume (a lean checkpoint converts in seconds) and
    deleted once loaded, so a copy can never be stale. Rank 0 converts into a scratch
    folder and renames it into place: a kill during conversion leaves no half-made copy.
    """
    target = Path(universal_root) / Path(tag_dir).name
    if rank == 0:
        if target.is_dir():  # left by a kill between this conversion and its load
            remove_universal_copy(target)
        scratch = target.with_name(f".tmp-{target.name}")
        shutil.rmtree(scratch, ignore_errors=True)
        (write or functools.partial(_ds_to_universal, Path(tag_dir)))(scratch)
        _readable_by_every_stage(scratch)
        os.replace(scratch, target)
    comm.barrier()
    return target.parent


def _ds_to_universal(tag_dir: Path, folder: Path) -> None:
    from argparse import Namespace

    load_deepspeed()
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    with library_reads(tag_dir):
        ds_to_universal(Namespace(input_folder=str(tag_dir), output_folder=str(folder), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))


def write_universal(folder: Path, handover: ckpt.Handover, model_states: dict, param_groups: list[dict]) -> None:
    """``handover`` (another engine's checkpoint) in the layout ``ds_to_universal`` makes of a DeepSpeed one:
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` per parameter, ``zero/optimizer_state.pt`` with the
    optimizer's ``param_groups`` (their hyper-parameters overwrite the engine's on load), and a model-states file
    with ``model_states`` (DeepSpeed's bookkeeping: ``param_shapes``, step counters) and the client state."""
    zero = Path(folder) / "zero"
    for name, state in handover.states.items():
        (zero / name).mkdir(parents=True)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.save({"param": state[key].float().contiguous()}, zero / name / f"{key}.pt")
        torch.save(handover.step, zero / name / "step.pt")
    torch.save({"param_groups": param_groups}, zero / "optimizer_state.pt")
    torch.save({**handover.client_state, **model_states}, Path(folder) / "mp_rank_00_model_states.pt")


def _readable_by_every_stage(folder: Path) -> None:
    """Let a universal copy be loaded by any ZeRO stage 1-3, whichever stage saved it.

    A universal copy restores weights and Adam moments per parameter from ``zero/<name>/``; the
    rest is stage-specific bookkeeping, which ``ds_to_universal`` writes in the saving stage's form:
    - the module-states file (read for client state only) is found by a stage-specific name,
      ``zero_pp_rank_0_mp_rank_00_model_states.pt`` for ZeRO-3, ``mp_rank_00_model_states.pt`` below;
    - ``zero/optimizer_state.pt``: stages 1-2 read its top-level ``param_groups`` and ``ds_version``
      (a ZeRO-3 save lacks the latter), ZeRO-3 reads ``optimizer_state_dict`` (its param groups and the
      Adam step), which a stage 1-2 save lacks;
    - each parameter's ``fp32``/``exp_avg``/``exp_avg_sq``: ZeRO-3 writes flat tensors, stages 1-2
      read ``{"param": tensor}`` in the parameter's shape (ZeRO-3 reads both forms), and a ``step``
      file that ZeRO-3 does not write.
    """
    names = [folder / "mp_rank_00_model_states.pt", folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    present = next((path for path in names if path.is_file()), None)
    for path in names:
        if present is not None and not path.exists():
            os.link(present, path)
    optimizer_file = folder / "zero" / "optimizer_state.pt"
    state = load_file(optimizer_file)
    before = set(state)
    if "optimizer_state_dict" not in state:
        step_file = next((folder / "zero").glob("*/step.pt"), None)
        step = load_file(step_file) if step_file else 0
        state["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": state["param_groups"]}
    if "ds_version" not in state:  # stages 1-2 refuse a file without it; a ZeRO-3 save does not write it
        load_deepspeed()
        from deepspeed import __version__

        state["ds_version"] = __version__
    if set(state) != before:
        torch.save(state, optimizer_file)
    # Per-parameter states: ZeRO-3 writes flat tensors, stages 1-2 read {"param": tensor of the parameter's shape}.
    shapes = {name: shape for group in load_file(present, mmap=True)["param_shapes"]
              for name, shape in group.items()}
    step = state["optimizer_state_dict"]["state"][0]["step"]
    for name, shape in shapes.items():
        if not (folder / "zero" / name / "step.pt").is_file():  # a ZeRO-3 save keeps the step in one place only
            torch.save(step, folder / "zero" / name / "step.pt")
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = folder / "zero" / name / f"{key}.pt"
            value = load_file(path) if path.is_file() else None
            if torch.is_tensor(value):
                torch.save({"param": value.view(shape)}, path)


def remove_universal_copy(target: Path) -> None:
    """Delete a universal copy once loaded; renamed first, so a kill mid-way never leaves a gutted one in place."""
    ckpt.delete_folders([Path(target)], Path(target).parent)
    (Path(target).parent / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer to it


class DeepSpeedCheckpoints(EngineCheckpoints):
    """runner_deepspeed's checkpoint folders, read without an engine."""

    FILES = ("*model_states.pt",)

    @classmethod
    def read_trained_weights(cls, tag_dir):
        return read_trained_weights(tag_dir)

    @classmethod
    def handover_shapes(cls, tag_dir, rank):
        """Carries over: fp32 masters and Adam moments of ZeRO 1-3 in fp32 or bf16. ZeRO-0 keeps no per-parameter
        moments; fp16's loss-scaler state has no counterpart in another engine."""
        states = load_file(model_states_file(tag_dir), mmap=True)
        layout = layout_of(states.get("ds_config") or {})
        stage = layout["zero_stage"]
        if stage == 0 or layout["precision"] == "fp16":
            why = ("ZeRO stage 0 (no per-parameter optimizer states to carry over)" if stage == 0 else
                   "fp16 (its loss-scaler state has no counterpart in another engine)")
            raise ckpt.CheckpointError(
                f"{tag_dir} was saved by runner_deepspeed with {why}; another engine continues DeepSpeed checkpoints "
                f"of ZeRO stages 1-3 in fp32 or bf16. Resume with run.runner: runner_deepspeed, or start afresh "
                f"(--options run.resume=false)")
        if rank == 0:  # rank 0 converts every partition
            check_files(files_of_rank(tag_dir, 0, same_world=False), stage)
        return saved_trainable(states)

    @classmethod
    def read_handover(cls, tag_dir, scratch, rank, needed=True):
        """Every trainable parameter's fp32 master and Adam moments, whole, from DeepSpeed's universal checkpoint
        form (made by rank 0, removed once every rank has read it)."""
        universal = universal_copy(tag_dir, scratch, rank) / tag_dir.name
        handover = None
        if needed:
            folder = universal / "zero"
            states = {name: {key: load_file(folder / name / f"{key}.pt")["param"]
                             for key in ("fp32", "exp_avg", "exp_avg_sq")}
                      for name in saved_trainable(load_file(model_states_file(tag_dir), mmap=True))}
            step = load_file(folder / next(iter(states)) / "step.pt")
            handover = ckpt.Handover(states, int(step), load_file(model_states_file(tag_dir)))
        comm.barrier()
        if rank == 0:
            remove_universal_copy(universal)
        return handover
