"""Where a trainer's optimizer step spends its time beyond the engine's own work, phase by phase.

    torchrun --nproc_per_node=2 benchmarks/step_profile.py [--runner runner_fsdp] [--stage 3] [--steps 100]

The trainer and its micro-batches are built as in ``benchmarks/step_time.py`` (same flags). Each phase the loop's
``run_step`` goes through is timed on every step (``time.perf_counter`` around the call, rank 0 reported): the
token counts, the objective's unit counts (supervised tokens, pairs), the step's agreement (one all-reduce, alone at
an epoch's first step only), reseeding, the forwards with every backward but the last (``forward_backward``), the
loss check's start (its all-reduce, which also carries the next step's agreement and its unit counts), the last
backward (during which that all-reduce travels), the check's finish (waiting for that all-reduce), the optimizer
step, the scheduler, the after_step hooks; and the whole step. Medians over the steps, in milliseconds; "rest" is,
per step, the whole step minus its phases (the loop's own lines: lr, counters, the wrappers).
Timings are printed, never asserted.
"""
from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_time  # noqa: E402  (puts the repository on sys.path)

from lavis_ds.common import comm, dist  # noqa: E402


_current_step = [0]  # the timed step the wrappers add to (main sets it)


def timed(times: dict[str, dict[int, float]], name: str, function):
    """``function``, its seconds added to ``times[name][step]``: a phase may run twice in a step (the agreement's
    unit counts, for this step and the next) or in some steps only (an epoch's first step agrees alone)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            per_step = times.setdefault(name, {})
            per_step[_current_step[0]] = per_step.get(_current_step[0], 0.0) + time.perf_counter() - start
    return wrapper


def instrument(trainer, times: dict[str, list[float]]) -> None:
    """Time every phase of ``trainer.run_step`` from outside (the functions it calls, wrapped where it finds them)."""
    from lavis_ds.runners import agreement, faults, losses, throughput
    from lavis_ds.runners import trainer as trainer_module

    throughput.count_tokens = timed(times, "count_tokens", throughput.count_tokens)
    agreement.unit_counts = timed(times, "unit_counts", agreement.unit_counts)
    trainer_module.seed_everything = timed(times, "seed_everything", trainer_module.seed_everything)
    # the loss check starts before the last backward and is finished after it
    trainer_module.LossCheck = timed(times, "loss check start", trainer_module.LossCheck)
    losses.LossCheck.finish = timed(times, "loss check finish", losses.LossCheck.finish)
    # an epoch's first step agrees alone; the others' agreement rides on the loss check
    faults.agree_on_step = timed(times, "agreement all_reduce", faults.agree_on_step)
    engine = trainer.engine
    engine.forward_backward = with_timed_last_backward(times, timed(times, "forward_backward",
                                                                    engine.forward_backward))
    engine.optimizer_step = timed(times, "optimizer_step", engine.optimizer_step)
    trainer.scheduler.step = timed(times, "scheduler", trainer.scheduler.step)
    trainer.call_hooks = timed(times, "after_step hooks", trainer.call_hooks)


def with_timed_last_backward(times: dict[str, dict[int, float]], forward_backward):
    """``forward_backward`` whose returned last backward (run by the loop, after the check's start) is timed too."""
    from lavis_ds.runners.engine import Forwarded

    @functools.wraps(forward_backward)
    def wrapper(*args, **kwargs):
        losses, last_backward = forward_backward(*args, **kwargs)
        return Forwarded(losses, timed(times, "last backward", last_backward))
    return wrapper


def main(argv=None) -> int:
    args = step_time.parse_args(argv)
    dist.set_single_process_defaults()
    import logging
    import shutil
    import tempfile

    import deepspeed

    import lavis_ds  # noqa: F401

    deepspeed.utils.logger.setLevel(logging.WARNING)
    output_dir = tempfile.mkdtemp(prefix="lavis_ds_step_profile_")
    trainer = step_time.build_trainer(args, output_dir)
    loader = trainer.data.epoch(0, 0)
    steps = [trainer.data.next_step(loader) for _ in range(min(args.distinct, trainer.data.steps_per_epoch))]
    warmup = step_time.stepping_as_the_loop(trainer, steps)
    for i in range(args.warmup):
        warmup(steps[i % len(steps)])
    times: dict[str, dict[int, float]] = {}
    instrument(trainer, times)
    step = timed(times, "whole step", step_time.stepping_as_the_loop(trainer, steps))
    comm.barrier()
    for i in range(args.steps):
        _current_step[0] = i
        step(steps[i % len(steps)])
    trainer.close()
    shutil.rmtree(output_dir, ignore_errors=True)
    if dist.is_main_process():
        per_step = {name: [per.get(i, 0.0) for i in range(args.steps)] for name, per in times.items()}
        whole = per_step.pop("whole step")
        print(f"\nrun_step phases, {args.runner} stage {args.stage} {args.dtype}, rank 0, median ms over {args.steps} "
              f"steps:")
        for name, values in per_step.items():
            ran = "" if len(times[name]) == args.steps else f"  (in {len(times[name])} of the {args.steps} steps)"
            print(f"  {name:<22}{statistics.median(values) * 1e3:>8.3f}{ran}")
        rest = [w - sum(values[i] for values in per_step.values()) for i, w in enumerate(whole)]
        for name, values in (("rest", rest), ("whole step", whole)):
            print(f"  {name:<22}{statistics.median(values) * 1e3:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
