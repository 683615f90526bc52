"""Optimizer-step time: a lavis_ds trainer against a minimal hand-written loop on the same engine.

    torchrun --nproc_per_node=2 benchmarks/step_time.py [--stage 2 --dtype fp32]
    torchrun --nproc_per_node=2 benchmarks/step_time.py --runner runner_fsdp [--dtype bf16]

With `--runner runner_fsdp` the raw loop is FSDP2 by hand: the same `fully_shard` units and
mixed-precision policy, torch AdamW (foreach, as the trainer's), `set_requires_gradient_sync` for accumulation,
clipping.

Both loops get the same model (the tiny BLIP2-Qwen of the demo YAML, built twice from
the same seed), the same DeepSpeed config (`build_deepspeed_config` of that YAML, with
the ZeRO stage and dtype set from the command line), the same optimizer groups (the
trainer's: no weight decay on biases and norms; `--raw-groups one` gives the raw loop a
single group instead, which is other math and, under ZeRO, fewer flat buffers) and the
same micro-batches. The
micro-batches are read once from the trainer's DataLoader and prepared by the model on the host
(`prepare_batch`: tokenizing, as the trainer's data side does before each step) before anything
is timed, and reused by both loops in the same order, so data loading is excluded from both.

What one timed step is (wall clock, `time.perf_counter`, on every rank):
  trainer `trainer.run_step(micro_batches, load_following)`: the real loop's step - the token
          counts, lr from the scheduler, cast + forward + `engine.backward` + `engine.step` per
          micro-batch, the loss all_reduce (which carries the next step's agreement: stop
          signals, failures and its supervised tokens), scheduler step, counters,
          hooks (progress bar, metrics.jsonl and TensorBoard every `run.log_freq` steps
          on rank 0).
  raw     per micro-batch: cast float tensors to the engine's device/dtype, `engine(batch)`,
          `engine.backward(loss)`, `engine.step()`. Nothing else.

After `--warmup` steps of each, the loops alternate in blocks of `--block` steps (trainer,
raw, trainer, raw, ...) so that changing machine load hits both alike. Reported: the
median over all timed steps of each loop and their ratio trainer/raw, and the median over
pairs of adjacent blocks of (trainer block mean / raw block mean), which cancels slow
drifts in load. `--block 1` pairs steps a few hundred milliseconds apart (faster drifts cancel too), at a cost
every loop pays alike: a step that follows the other loop's finds the cache holding the other model. Timings are
printed, never asserted: shared machines are noisy.

`--control` adds a third loop, a second raw loop built exactly as the first (its own model from the same seed,
its own engine), timed in the same alternation: its ratio to the first raw loop should be 1, and how far it is
from 1 is what this run can resolve (an A/A comparison). On a shared 2-core machine it was off by 0.3-8 %.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from lavis_ds.common import comm, dist  # noqa: E402

LOOPS = ("trainer", "raw", "control")  # the order within each round of blocks (control: with --control only)


def add_trainer_args(parser: argparse.ArgumentParser) -> None:
    """The flags ``build_trainer`` reads: the run YAML, the engine, its ZeRO stage and precision."""
    parser.add_argument("--cfg-path", default=str(REPO / "projects/demo/tiny_zero2.yaml"), help="run YAML")
    parser.add_argument("--runner", default="runner_deepspeed", choices=("runner_deepspeed", "runner_fsdp"))
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage (DeepSpeed)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="engine precision")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trainer_args(parser)
    parser.add_argument("--steps", type=int, default=200, help="timed optimizer steps per loop")
    parser.add_argument("--block", type=int, default=10, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps per loop, first")
    parser.add_argument("--distinct", type=int, default=20,
                        help="optimizer steps' worth of micro-batches to read up front and cycle through")
    parser.add_argument("--options", nargs="+", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures (and tokens, FLOPs and peak memory per step) to this file")
    parser.add_argument("--raw-groups", default="same", choices=("same", "one"),
                        help="the raw loop's optimizer groups: the trainer's decay/no-decay groups (same math), "
                             "or one group of every trainable parameter")
    parser.add_argument("--control", action="store_true",
                        help="also time a second raw loop built as the first: their ratio is this run's resolution")
    parser.add_argument("--pin", action="store_true",
                        help="bind each process to one core (Linux): less scheduling noise on a small machine")
    args = parser.parse_args(argv)
    if args.steps % args.block:
        parser.error(f"--steps {args.steps} is not a multiple of --block {args.block}")
    return args


def build_trainer(args: argparse.Namespace, output_dir: str):
    """The trainer of the YAML on its engine, its hooks set up as `train()` would, no resume."""
    from lavis_ds.build import build_datasets, build_model, prepare_datasets
    from lavis_ds.config import load_config
    from lavis_ds.common.registry import registry
    from lavis_ds.runners import Trainer

    options = [f"run.output_dir={output_dir}", "run.resume=false", "run.save_freq_steps=0", f"run.runner={args.runner}",
               # total_steps only shapes the lr curve and the progress bar; make it outlast the benchmark
               "run.max_epoch=1000",
               f"run.zero_stage={args.stage}",
               f"run.precision={args.dtype}", *args.options]
    cfg = load_config(args.cfg_path, options, world_size=int(os.environ["WORLD_SIZE"]))
    setup = registry.get_engine_class(cfg.run.runner).setup
    setup.prepare_process(cfg)  # as train() starts a process: DeepSpeed's ops readied, the config checked
    setup.init_process_group()
    prepare_datasets(cfg.datasets)  # the demo's data and tokenizer, generated on first use
    trainer = Trainer.from_config(cfg, build_model(cfg.model, cfg.run.seed), build_datasets(cfg.datasets))
    trainer.setup()  # the engine, the data order and the hooks, as train() starts
    trainer.call_hooks("before_train")  # the logging hook opens its writer and progress bar here
    trainer.engine.module.train()  # as train() leaves it before its loop
    return trainer


def build_raw_fsdp_step(cfg, args) -> Callable[[list[dict]], None]:
    """FSDP2 by hand: a second model from the same seed, the same units and policy, torch AdamW."""
    import torch
    from omegaconf import OmegaConf
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lavis_ds.build import build_model
    from lavis_ds.common.run_config import training_settings

    settings = training_settings(OmegaConf.to_container(cfg.run, resolve=True), dist.world_size())
    dtype = torch.bfloat16 if settings.precision == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else \
        MixedPrecisionPolicy()
    model = build_model(cfg.model, cfg.run.seed)
    for block in model.repeated_blocks():
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(_param_groups(model, cfg, args.raw_groups), lr=cfg.run.init_lr, foreach=True)
    model.train()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def raw_step(micro_batches: list[dict]) -> None:
        for i, batch in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            batch = {k: v.to(device, dtype if v.is_floating_point() else None, non_blocking=True)
                     if torch.is_tensor(v) else v for k, v in batch.items()}
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(batch)["loss"]
            (loss / len(micro_batches)).backward()
        if settings.grad_norm_clip:
            torch.nn.utils.clip_grad_norm_(params, settings.grad_norm_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return raw_step


def build_raw_step(cfg, args) -> Callable[[list[dict]], None]:
    """What a user writes by hand: a second model from the same seed, the same DeepSpeed JSON."""
    import deepspeed
    import torch
    from omegaconf import OmegaConf

    from lavis_ds.build import build_model
    from lavis_ds.runners.deepspeed.section import build_deepspeed_config

    ds_config = build_deepspeed_config(OmegaConf.to_container(cfg.run, resolve=True), dist.world_size())
    model = build_model(cfg.model, cfg.run.seed)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=_param_groups(model, cfg, args.raw_groups))
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    engine.train()

    def raw_step(micro_batches: list[dict]) -> None:
        for batch in micro_batches:
            batch = {k: v.to(engine.device, dtype if v.is_floating_point() else None) if torch.is_tensor(v) else v
                     for k, v in batch.items()}
            loss = engine(batch)["loss"]
            engine.backward(loss)
            engine.step()

    return raw_step


def _param_groups(model, cfg, kind: str) -> list[dict]:
    """The raw loop's optimizer groups: the trainer's own (``same``: no weight decay on biases, norms and 1-d
    parameters, lr_scales), or all trainable parameters in one decayed group (``one``: the least a loop does)."""
    from lavis_ds.optim import build_param_groups

    if kind == "same":
        return build_param_groups(model, cfg.run.weight_decay, dict(cfg.run.lr_scales))
    return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": cfg.run.weight_decay}]


def interleave(loops: dict[str, Callable], steps: list[list[dict]], warmup: int, block: int,
               n_blocks: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm each loop up, then alternate blocks; return (seconds per timed step, mean of each block)."""
    done = dict.fromkeys(loops, 0)
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    block_means: dict[str, list[float]] = {name: [] for name in loops}

    def run_block(name: str, n: int) -> list[float]:
        times = []
        for _ in range(n):
            micro_batches = steps[done[name] % len(steps)]  # step i of either loop sees the same data
            _synchronize()
            start = time.perf_counter()
            loops[name](micro_batches)
            _synchronize()  # a GPU step is done when its kernels are, not when the host has queued them
            times.append(time.perf_counter() - start)
            done[name] += 1
        return times

    for name in loops:
        run_block(name, warmup)
    comm.barrier()
    for _ in range(n_blocks):
        for name in loops:
            times = run_block(name, block)
            per_step[name] += times
            block_means[name].append(statistics.fmean(times))
    return per_step, block_means


def pin_to_one_core() -> None:
    """Bind this process to core ``LOCAL_RANK`` (mod the cores it may use): with one process per core the
    scheduler stops moving them, which on a small machine is most of the noise between two loops' times."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", 0)) % len(cores)]})


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.set_single_process_defaults()
    if args.pin:
        pin_to_one_core()
    import deepspeed

    import lavis_ds  # noqa: F401  (fills the registries)

    deepspeed.utils.logger.setLevel(logging.WARNING)  # initialize() prints pages at INFO
    output_dir = tempfile.mkdtemp(prefix="lavis_ds_step_time_")  # the trainer's metrics.jsonl + TensorBoard
    trainer = build_trainer(args, output_dir)

    # Read once, before anything is timed: data loading is in neither loop.
    loader = trainer.data.epoch(0, 0)
    steps = [trainer.data.next_step(loader) for _ in range(min(args.distinct, trainer.data.steps_per_epoch))]

    raw = build_raw_fsdp_step if args.runner == "runner_fsdp" else build_raw_step
    loops = {"trainer": stepping_as_the_loop(trainer, steps), "raw": raw(trainer.cfg, args)}
    if args.control:
        loops["control"] = raw(trainer.cfg, args)
    per_step, block_means = interleave({name: loops[name] for name in LOOPS if name in loops}, steps, args.warmup,
                                       args.block, args.steps // args.block)
    trainer.close()  # not call_hooks("after_train"): that would also run the test generation
    shutil.rmtree(output_dir, ignore_errors=True)

    summary = {name: _summary(per_step[name], block_means[name]) for name in loops}
    summary["paired_ratio"] = _paired(block_means, "trainer")
    if args.control:
        summary["control_paired_ratio"] = _paired(block_means, "control")
    per_rank = comm.all_gather_object(summary)
    if dist.is_main_process():
        _report(args, trainer, per_rank)
        if args.json:
            from lavis_ds.common.hardware import device_name

            args.json.write_text(json.dumps({**summary, **_work_per_step(trainer, steps), "engine": args.runner,
                                             "device": device_name(),  # where CUDA is in use: this process
                                             "stage": args.stage, "dtype": args.dtype,
                                             "world_size": trainer.world_size,
                                             "global_batch": trainer.plan.global_batch}))
    return 0


def stepping_as_the_loop(trainer, steps: list[list[dict]]) -> Callable[[list[dict]], None]:
    """``runner.run_step`` as ``Trainer.train`` calls it: with the next step's micro-batches to load during the
    step (here: the next of ``steps``, already read), so that its agreement rides on this step's loss check."""
    position = itertools.count(1)

    def run_step(micro_batches: list[dict]) -> None:
        following = steps[next(position) % len(steps)]
        trainer.run_step(micro_batches, lambda: following)

    return run_step


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _work_per_step(trainer, steps: list[list[dict]]) -> dict:
    """Per optimizer step of this rank, averaged over the steps read: samples, tokens, supervised tokens, training
    FLOPs (lavis_ds.models.flops, real tokens only) and the peak memory the process reached."""
    from lavis_ds.common.hardware import peak_memory_bytes
    from lavis_ds.runners.throughput import count_tokens

    counts = [count_tokens(step) for step in steps]
    flop_model = trainer.engine.module.flop_model()
    flops = [flop_model.training_flops(c.images, c.tokens, c.squared_tokens, c.supervised, c.image_text_tokens,
                                       c.squared_image_text_tokens, c.image_sizes) for c in counts]
    return {"samples": statistics.fmean(c.samples for c in counts), "tokens": statistics.fmean(c.tokens for c in counts),
            "supervised": statistics.fmean(c.supervised for c in counts), "flops": statistics.fmean(flops),
            "peak_memory_gib": peak_memory_bytes() / 2**30}


def _paired(block_means: dict[str, list[float]], name: str) -> float:
    """The median over adjacent blocks of (``name``'s block mean / the raw loop's)."""
    return statistics.median(a / b for a, b in zip(block_means[name], block_means["raw"]))


def _median_ratios(per_rank: list[dict], name: str) -> str:
    """``name``'s median over the raw loop's, rank 0's first, then the other ranks' (``; rank i: r``)."""
    ratios = [r[name]["median"] / r["raw"]["median"] for r in per_rank]
    return f"{ratios[0]:.3f}" + "".join(f"; rank {i}: {r:.3f}" for i, r in enumerate(ratios) if i)


def _summary(per_step: list[float], block_means: list[float]) -> dict:
    quartiles = statistics.quantiles(per_step, n=4)
    return {"median": statistics.median(per_step), "p25": quartiles[0], "p75": quartiles[2],
            "block_median": statistics.median(block_means)}


def _report(args, trainer, per_rank: list[dict]) -> None:
    ms = 1e3
    engine = "FSDP2" if args.runner == "runner_fsdp" else f"ZeRO-{args.stage}"
    print(f"\nstep time: {args.runner} ({engine}) {args.dtype}, {trainer.world_size} processes, micro-batch "
          f"{trainer.plan.micro_batch} x accumulation {trainer.plan.accum} "
          f"(global batch {trainer.plan.global_batch}); "
          f"{args.warmup} warm-up steps, then {args.steps} timed steps per loop in alternating blocks of "
          f"{args.block}; data loading excluded")
    print(f"{'loop':<8}{'median ms':>11}{'p25 ms':>9}{'p75 ms':>9}{'median of block means ms':>27}")
    for name in [name for name in LOOPS if name in per_rank[0]]:
        s = per_rank[0][name]
        print(f"{name:<8}{s['median'] * ms:>11.1f}{s['p25'] * ms:>9.1f}{s['p75'] * ms:>9.1f}"
              f"{s['block_median'] * ms:>27.1f}")
    print(f"ratio trainer/raw (medians, rank 0): {_median_ratios(per_rank, 'trainer')}")
    print(f"ratio trainer/raw (median over pairs of adjacent blocks, rank 0): {per_rank[0]['paired_ratio']:.3f}",
          flush=True)
    if "control" in per_rank[0]:
        print(f"ratio control/raw, two identical raw loops (medians, rank 0): {_median_ratios(per_rank, 'control')}"
              f"; paired blocks: {per_rank[0]['control_paired_ratio']:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
