"""Optimizer-step time: lavis_ds's DeepSpeedRunner against a minimal hand-written DeepSpeed loop.

    torchrun --nproc_per_node=2 benchmarks/step_time.py [--stage 2 --dtype fp32]

Both loops get the same model (the tiny BLIP2-Qwen of the demo YAML, built twice from
the same seed), the same DeepSpeed config (`build_deepspeed_config` of that YAML, with
the ZeRO stage and dtype set from the command line) and the same micro-batches. The
micro-batches are read once from the runner's DataLoader before anything is timed and
reused by both loops in the same order, so data loading is excluded from both.

What one timed step is (wall clock, `time.perf_counter`, on every rank):
  runner  `runner.run_step(micro_batches)`: the real loop's step - lr from the scheduler,
          cast + forward + `engine.backward` + `engine.step` per micro-batch, the loss
          all_reduce, scheduler step, counters, hooks (progress bar, metrics.jsonl and
          TensorBoard every `run.log_freq` steps on rank 0).
  raw     per micro-batch: cast float tensors to the engine's device/dtype, `engine(batch)`,
          `engine.backward(loss)`, `engine.step()`. Nothing else.

After `--warmup` steps of each, the loops alternate in blocks of `--block` steps (runner,
raw, runner, raw, ...) so that changing machine load hits both alike. The table gives
medians over all timed steps; the ratio is runner/raw of those medians. Timings are
reported, never asserted: shared machines are noisy.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg-path", default=str(REPO / "projects/demo/tiny_zero2.yaml"), help="run YAML")
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="engine precision")
    parser.add_argument("--steps", type=int, default=200, help="timed optimizer steps per loop")
    parser.add_argument("--block", type=int, default=10, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps per loop first")
    parser.add_argument("--distinct", type=int, default=20,
                        help="distinct optimizer steps' worth of micro-batches to read and cycle through")
    parser.add_argument("--options", nargs="+", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = parser.parse_args(argv)
    if args.steps % args.block:
        parser.error(f"--steps {args.steps} is not a multiple of --block {args.block}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from lavis_ds.common import dist

    dist.set_single_process_defaults()
    world_size = int(os.environ["WORLD_SIZE"])

    import deepspeed
    import torch
    from omegaconf import OmegaConf

    import lavis_ds  # noqa: F401  (fills the registries)
    from lavis_ds.build import build_datasets, build_model
    from lavis_ds.common.config import load_config
    from lavis_ds.common.registry import registry
    from lavis_ds.common.run_config import build_deepspeed_config

    deepspeed.utils.logger.setLevel(logging.WARNING)  # initialize() prints pages at INFO
    output_dir = tempfile.mkdtemp(prefix="lavis_ds_step_time_")  # metrics.jsonl + TensorBoard of the runner
    bf16 = args.dtype == "bf16"
    options = [f"run.output_dir={output_dir}", "run.resume=false", "run.save_freq_steps=0",
               # total_steps only shapes the lr curve and the progress bar; make it outlast the benchmark
               "run.max_epoch=1000",
               f"run.deepspeed_config.zero_optimization.stage={args.stage}",
               f"run.deepspeed_config.bf16.enabled={str(bf16).lower()}", *args.options]
    cfg = load_config(args.cfg_path, options, world_size=world_size)
    dist.init_distributed()
    rank = dist.rank()

    runner = registry.get_runner_class(cfg.run.runner)(cfg, build_model(cfg.model, cfg.run.seed),
                                                       build_datasets(cfg.datasets))
    runner.call_hooks("before_train")  # sets up the logging hook, as train() would

    # The micro-batches, read once: step i of either loop gets steps[i % len(steps)].
    runner.sampler.set_position(0, 0)
    loader = iter(runner.train_loader)
    n_distinct = min(args.distinct, runner.steps_per_epoch)
    steps = [[next(loader) for _ in range(runner.accum)] for _ in range(n_distinct)]

    # The raw loop: a second model from the same seed, the same DeepSpeed JSON.
    ds_config = build_deepspeed_config(OmegaConf.to_container(cfg.run, resolve=True), world_size)
    raw_model = build_model(cfg.model, cfg.run.seed)
    engine, *_ = deepspeed.initialize(model=raw_model, config=ds_config,
                                      model_parameters=[p for p in raw_model.parameters() if p.requires_grad])
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    engine.train()

    def raw_step(micro_batches: list[dict]) -> None:
        for batch in micro_batches:
            batch = {k: v.to(engine.device, dtype if v.is_floating_point() else None) if torch.is_tensor(v) else v
                     for k, v in batch.items()}
            loss = engine(batch)["loss"]
            engine.backward(loss)
            engine.step()

    loops = {"runner": runner.run_step, "raw": raw_step}
    done = {name: 0 for name in loops}
    times: dict[str, list[float]] = {name: [] for name in loops}
    block_means: dict[str, list[float]] = {name: [] for name in loops}

    def run_block(name: str, n: int, timed: bool) -> None:
        step_fn, per_step = loops[name], []
        for _ in range(n):
            micro_batches = steps[done[name] % len(steps)]
            start = time.perf_counter()
            step_fn(micro_batches)
            per_step.append(time.perf_counter() - start)
            done[name] += 1
        if timed:
            times[name] += per_step
            block_means[name].append(statistics.fmean(per_step))

    for name in loops:
        run_block(name, args.warmup, timed=False)
    dist.barrier()
    for _ in range(args.steps // args.block):
        for name in loops:
            run_block(name, args.block, timed=True)
    for hook in runner.hooks:  # not call_hooks("after_train"): that would also run the test generation
        if getattr(hook, "bar", None) is not None:
            hook.bar.close()
    runner.close()
    shutil.rmtree(output_dir, ignore_errors=True)

    summary = {name: _summary(times[name], block_means[name]) for name in loops}
    # Adjacent blocks saw nearly the same machine load: their ratio cancels slow drifts.
    summary["paired_ratio"] = statistics.median(a / b for a, b in zip(block_means["runner"], block_means["raw"]))
    gathered = [summary]
    if world_size > 1:
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, summary)
    if rank == 0:
        _report(args, runner, world_size, gathered)
    return 0


def _summary(per_step: list[float], block_means: list[float]) -> dict:
    quartiles = statistics.quantiles(per_step, n=4)
    return {"median": statistics.median(per_step), "p25": quartiles[0], "p75": quartiles[2],
            "block_median": statistics.median(block_means), "n": len(per_step)}


def _report(args, runner, world_size: int, per_rank: list[dict]) -> None:
    ms = 1e3
    print(f"\nstep time: ZeRO-{args.stage} {args.dtype}, {world_size} processes, micro-batch {runner.micro_batch} "
          f"x accumulation {runner.accum} (global batch {runner.global_batch}); {args.warmup} warm-up steps, then "
          f"{args.steps} timed steps per loop in alternating blocks of {args.block}; data loading excluded")
    print(f"{'loop':<8}{'median ms':>11}{'p25 ms':>9}{'p75 ms':>9}{'median of block means ms':>27}")
    for name in ("runner", "raw"):
        s = per_rank[0][name]
        print(f"{name:<8}{s['median'] * ms:>11.1f}{s['p25'] * ms:>9.1f}{s['p75'] * ms:>9.1f}"
              f"{s['block_median'] * ms:>27.1f}")
    ratios = [r["runner"]["median"] / r["raw"]["median"] for r in per_rank]
    print(f"ratio runner/raw (medians, rank 0): {ratios[0]:.3f}"
          + "".join(f"; rank {i}: {r:.3f}" for i, r in enumerate(ratios) if i))
    print(f"ratio runner/raw (median over pairs of adjacent blocks, rank 0): {per_rank[0]['paired_ratio']:.3f}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
