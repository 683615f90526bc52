"""Run on 2 processes by test_partitioned_build.py (forked: ``cli``): build a run's model the way train.py does, in
the place its engine asks for, and report what each process holds.

    torchrun --nproc_per_node=2 tests/placement_worker.py <run.yaml> <report.json> engine [engine ...]

For each engine named, the model is built twice: in the place the engine asks for (``setup.model_placement``) and
whole, as before. For each build, on every process: how many elements of the LLM's own weights (no LoRA
adapters, no token rows) this process holds right after the build - materialised in full, as its ZeRO-3
partition, or on the meta device - and after the engine wrapped the model; and the loss of one fixed batch
before and after one optimizer step on it, and whether the engine let the loop start its loss check before
the backward. Process 0 writes
``{"<engine>/<partitioned|whole>": [report of rank 0, report of rank 1, ...]}``.
"""
from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import torch.distributed as torch_dist

LLM_PREFIX = "llm_model."


def base_llm_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LLM's own weights: what a from_pretrained folder holds (adapters and token rows are not)."""
    return {name: p for name, p in model.named_parameters()
            if name.startswith(LLM_PREFIX) and "lora_" not in name and not name.endswith(".rows")}


def held(params: dict[str, torch.nn.Parameter]) -> dict:
    """Elements of ``params`` this process holds, by kind, and how many elements the weights have in all."""
    out = {"total": 0, "full": 0, "partition": 0, "meta": 0, "shard": 0, "unpartitioned": []}
    for name, p in params.items():
        if hasattr(p, "ds_id"):  # ZeRO-3: `p.data` is empty outside a gather, `ds_tensor` is this rank's piece
            out["total"] += p.ds_numel
            out["partition"] += p.ds_tensor.numel()
            out["full"] += p.data.numel()
        elif hasattr(p, "to_local"):  # FSDP2 DTensor
            out["total"] += p.numel()
            out["shard"] += p.to_local().numel()
        elif p.is_meta:
            out["total"] += p.numel()
            out["meta"] += p.numel()
        else:
            out["total"] += p.numel()
            out["full"] += p.numel()
            out["unpartitioned"].append(name)
    out["unpartitioned"] = out["unpartitioned"][:5]
    return out


def fixed_batch() -> dict:
    return {"image": torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)),
            "instruction": [["<Img><ImageHere></Img> What is in the image?"], ["Describe the picture in detail."]],
            "output": [["A cat sitting on a mat."], ["A dog runs on the grass."]]}


def report_for(cfg, partitioned: bool) -> dict:
    """Build (in the engine's placement, or whole), wrap, and take one optimizer step on the fixed batch."""
    import contextlib
    import gc

    from lavis_ds.build import build_datasets, build_model
    from lavis_ds.common.registry import registry
    from lavis_ds.runners import Trainer

    engine_class = registry.get_engine_class(cfg.run.runner)
    placement = engine_class.setup.model_placement(cfg) if partitioned else contextlib.nullcontext()
    model = build_model(cfg.model, cfg.run.seed, placement)
    built = held(base_llm_params(model))
    trainer = Trainer.from_config(cfg, model, build_datasets(cfg.datasets))
    trainer.setup()  # wraps the model
    engine = trainer.engine
    wrapped = held(base_llm_params(engine.module))
    engine.module.train()
    torch.manual_seed(0)  # LoRA dropout draws alike in both builds
    events = noting_backward(engine.module)
    step_losses, last_backward = engine.forward_backward([fixed_batch()], None)
    events.append("returned")  # the loop's loss check starts here, before the last backward
    gathered = units_gathered(engine.module)  # between the forward and the backward
    last_backward()
    losses = [float(step_losses[0])]
    engine.optimizer_step()
    engine.module.eval()
    with torch.no_grad():
        losses.append(float(engine.forward(fixed_batch())["loss"]))
    del trainer, engine, model, last_backward
    gc.collect()
    return {"built": built, "wrapped": wrapped, "losses": losses, "events": events, "gathered": gathered}


def units_gathered(model: torch.nn.Module) -> dict[str, bool]:
    """Under FSDP2, whether a parameter of the root unit (one no repeated block holds) and one of a block are
    gathered now (a whole tensor, not this process's DTensor shard); empty under other engines."""
    params = list(model.parameters())
    if not any(hasattr(p, "to_local") for p in params):
        return {}
    in_blocks = {id(p) for block in model.repeated_blocks() for p in block.parameters()}
    root = next(p for p in params if id(p) not in in_blocks)
    block = next(p for p in params if id(p) in in_blocks)
    return {"root": not hasattr(root, "to_local"), "block": not hasattr(block, "to_local")}


def noting_backward(model: torch.nn.Module) -> list[str]:
    """A list to which ``model``'s training forwards add "backward" when the backward of their loss starts: the
    engine must return to the loop (which starts its loss check there) before it, so that the check's all-reduce
    overlaps the backward."""
    events, forward = [], model.forward

    def forward_noting_backward(batch):
        out = forward(batch)
        if out["loss"].requires_grad:
            out["loss"].register_hook(lambda grad: events.append("backward"))
        return out

    model.forward = forward_noting_backward  # nn.Module.__call__ finds it on the instance, under any wrapper
    return events


def main(cfg_path: str, report_path: str, engines: list[str]) -> None:
    importlib.import_module("lavis_ds")  # fills the registries
    from lavis_ds.common.registry import registry
    from lavis_ds.config import load_config

    world = int(os.environ["WORLD_SIZE"])
    reports = {}
    for name in engines:
        cfg = load_config(cfg_path, [f"run.runner={name}"], world_size=world)
        engine_class = registry.get_engine_class(name)
        engine_class.setup.prepare_process(cfg)
        engine_class.setup.init_process_group()  # once: a started process group is kept
        for partitioned in (True, False):
            mine = report_for(cfg, partitioned)
            everyone = [None] * torch_dist.get_world_size()
            torch_dist.all_gather_object(everyone, mine)
            reports[f"{name}/{'partitioned' if partitioned else 'whole'}"] = everyone
    if torch_dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(reports, f)


def cli(argv: list[str]) -> int:
    """The command line above: ``<run.yaml> <report.json> engine [engine ...]``."""
    main(argv[0], argv[1], argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
