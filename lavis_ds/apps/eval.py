"""``lavis-ds eval``: lmms-eval's benchmarks on a lavis_ds run, checkpoint or export, with lmms-eval's result files.

    lavis-ds eval --model output/demo --tasks demo_shapes_caption,demo_shapes_colour \\
        --include_path projects/demo/lmms_eval --output_path eval/ --log_samples
    torchrun --nproc_per_node=4 --no-python lavis-ds eval --model exports/demo --tasks mmbench_en_dev --batch_size 8

``--model``: an export folder, a checkpoint folder (``<output_dir>/checkpoints/step_<N>``) or a run's output_dir
(its newest complete checkpoint). The flags are lmms-eval's own where they apply; the same evaluation is
``lmms-eval --model lavis_ds --model_args pretrained=PATH ...`` (lavis_ds registers the model with lmms-eval).
``--output_path`` receives lmms-eval's files: ``<model>/<date>_results.json`` and, with ``--log_samples``,
``<date>_samples_<task>.jsonl`` per task. docs/evaluation.md says how to point a task at a local copy of a
benchmark. On several processes an evaluation that fails on one of them (a task's scoring on rank 0, a document a
rank cannot load, a model folder a rank cannot read) stops every process with one ``lavis_ds:`` line naming the task
or step and the rank, and a non-zero code.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from lavis_ds.common.errors import InputError, LavisDsError, report

PROG = "lavis-ds eval"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="export folder, checkpoint folder or a run's output_dir")
    parser.add_argument("--tasks", required=True, help="comma-separated lmms-eval task names (wildcards allowed)")
    parser.add_argument("--include_path", action="append", help="a folder of task YAMLs beside lmms-eval's own "
                                                                "(repeatable), e.g. projects/demo/lmms_eval")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (a fraction below 1)")
    parser.add_argument("--batch_size", type=int, default=1, help="requests per call (per process)")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--output_path", default=None, help="folder for lmms-eval's result files")
    parser.add_argument("--log_samples", action="store_true", help="also write every document's prompt and answer")
    parser.add_argument("--gen_kwargs", default=None, help="generation settings over every task's, "
                                                           "e.g. max_new_tokens=32,num_beams=2")
    parser.add_argument("--seed", type=int, default=0, help="lmms-eval's random, numpy and torch seeds")
    parser.add_argument("--device", default="cpu", help="where to run (under torchrun: each process's own GPU)")
    parser.add_argument("--dtype", default="auto", help="auto (the dtype it trained in), fp32, bf16 or fp16")
    return parser


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Check the tasks, load the model, run lmms-eval, write its files; the results lmms-eval returns."""
    from lavis_ds.runners.lmms_eval import require_lmms_eval

    require_lmms_eval()
    from lmms_eval.loggers import EvaluationTracker
    from lmms_eval.utils import get_datetime_str, make_table

    from lavis_ds.apps.eval_model import MODEL_NAME, PretrainedLavisDsLmms
    from lavis_ds.common import dist
    from lavis_ds.runners.lmms_eval.failures import cause_of, what_failed
    from lavis_ds.runners.lmms_eval.tasks import check_datasets_on_disk, check_task_names, task_manager

    if args.log_samples and not args.output_path:
        raise InputError("--log_samples writes files: give --output_path")
    device = _device(args.device)

    def prepare() -> tuple[list[str], Any, PretrainedLavisDsLmms]:
        manager = task_manager(args.include_path, args.tasks.split(","))
        tasks = check_task_names(args.tasks.split(","), manager)
        check_datasets_on_disk(tasks, manager)
        model = PretrainedLavisDsLmms.from_pretrained(args.model, device=device, dtype=args.dtype,
                                                      batch_size=args.batch_size, hold_failures=_processes() > 1)
        return tasks, manager, model

    # Agreed before any rank enters lmms-eval: a rank that cannot read the model folder or a task's documents (a path
    # one node lacks) would leave the others waiting in lmms-eval's first collective.
    tasks, manager, model = _on_every_rank(
        prepare, lambda e: f"preparing the evaluation failed on rank {dist.rank()}: {cause_of(e)}")
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    datetime_str = get_datetime_str()  # names the result files, as lmms-eval's CLI names them
    results = _on_every_rank(lambda: _simple_evaluate(args, model, tasks, manager, datetime_str, tracker),
                             lambda e: what_failed(e, tasks))
    if results is None:  # a rank other than 0: lmms-eval gathers the results on rank 0
        return {}
    samples = results.pop("samples", None)
    if tracker is not None:
        results["config"]["model"] = MODEL_NAME
        tracker.save_results_aggregated(results=results, samples=samples, datetime_str=datetime_str)
        for task in results["configs"] if args.log_samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    print(make_table(results))
    return results


def _simple_evaluate(args: argparse.Namespace, model, tasks: list[str], manager, datetime_str: str,
                     tracker) -> dict[str, Any] | None:
    """lmms-eval's ``simple_evaluate`` with the command's flags; its results on rank 0, else None."""
    from lmms_eval import evaluator

    from lavis_ds.runners.lmms_eval.tasks import hub_dataset_error

    try:
        results = evaluator.simple_evaluate(
            model=model, model_args=f"pretrained={args.model}", tasks=tasks, num_fewshot=args.num_fewshot,
            batch_size=args.batch_size, limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
            log_samples=args.log_samples, evaluation_tracker=tracker, gen_kwargs=args.gen_kwargs,
            task_manager=manager, random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
            fewshot_random_seed=args.seed, datetime_str=datetime_str,
            distributed_executor_backend="torchrun" if _processes() > 1 else "accelerate")
    except LavisDsError:
        raise
    except Exception as e:  # a hub dataset that is not on disk is found only when it loads
        offline = hub_dataset_error(e, tasks, manager)
        if offline is None:
            raise
        raise offline from None
    if model.failure is not None:  # a request this rank could not prepare, held while the others needed it
        raise model.failure
    return results


def _on_every_rank(work: Callable[[], Any], line_of: Callable[[Exception], str]) -> Any:
    """``work()``; on several processes the ranks then agree on whether it failed on any, as the ``lmms_eval`` hook
    does (``lmms_eval.failures``): a rank that fails alone (rank 0 while lmms-eval scores, a rank that cannot load the
    model or prepare a request) would leave the others waiting in a collective until the NCCL timeout. A failure
    anywhere raises on every rank; the rank it happened on reports ``lavis-ds eval: <line_of(error)>``, the others
    exit with its code silently."""
    if _processes() < 2:
        return work()
    from lavis_ds.runners.lmms_eval.failures import EvaluationFailed, evaluated_together

    result, _ = evaluated_together(work, lambda e: EvaluationFailed.from_error(f"{PROG}: {line_of(e)}", e),
                                   train_on=False)
    return result


def _processes() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def _device(device: str) -> str:
    """Under a launcher each process starts the process group and binds its own GPU (``--device cuda`` is it)."""
    if _processes() > 1:
        from lavis_ds.common import comm
        from lavis_ds.common.device import bind_local_device

        bind_local_device()
        comm.init_process_group()
    if device == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return device


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch_size must be >= 1, got {args.batch_size}")
    try:
        evaluate(args)
    except (LavisDsError, ValueError) as e:  # a bad task, dataset, model folder or request: one line
        if not getattr(e, "quiet", False):  # a peer's failure: the rank it happened on reports it
            report(str(e))
        return getattr(e, "exit_code", 2)
    return 0


if __name__ == "__main__":
    from lavis_ds.common.dist import exit_now

    exit_now(main())
