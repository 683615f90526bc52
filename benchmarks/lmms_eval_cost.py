"""An in-loop lmms-eval evaluation of N requests against a training step, on the same trainer.

    python benchmarks/lmms_eval_cost.py [--requests 16] [--steps 20]
    torchrun --nproc_per_node=2 benchmarks/lmms_eval_cost.py --runner runner_fsdp --stage 3

The trainer is the demo YAML's (the tiny BLIP2-Qwen; `--cfg-path` for another), built as ``step_time.py`` builds it,
with `run.lmms_eval` set to the demo's offline task (`--tasks`, `--include-path`) and `limit` = `--requests`
documents. First `--warmup` untimed steps, then `--steps` timed optimizer steps (the real loop's
``trainer.run_step``, data read up front), then `--repeats` timed evaluations through the hook itself
(``LmmsEval.run_lmms_eval``: lmms-eval's ``simple_evaluate`` on the live model, every rank its share). Wall clock
on every rank, the slowest rank's figure reported. Reported: the median step, the median evaluation, its time per
request and its ratio to a step, and the share an evaluation every `--every` steps takes of the wall time
(eval / (eval + every x step)). Timings are printed, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import REPO, add_trainer_args, build_trainer, stepping_as_the_loop  # noqa: E402  (beside this file)

from lavis_ds.common import comm, dist  # noqa: E402

DEMO_TASKS = REPO / "projects" / "demo" / "lmms_eval"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trainer_args(parser)
    parser.add_argument("--tasks", default="demo_shapes_caption", help="lmms-eval tasks, comma-separated")
    parser.add_argument("--include-path", default=str(DEMO_TASKS), help="folder of task YAMLs")
    parser.add_argument("--requests", type=int, default=16,
                        help="documents per task (lmms-eval's limit; a multiple-choice document is a request per "
                             "option)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per generate call")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=100,
                        help="untimed optimizer steps, first: the model learns to answer in captions (an untrained "
                             "model answers with its end token at once: a generation one token long)")
    parser.add_argument("--repeats", type=int, default=3, help="timed evaluations")
    parser.add_argument("--every", type=int, default=500, help="steps between evaluations, for the reported share")
    parser.add_argument("--options", nargs="+", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.set_single_process_defaults()
    import lavis_ds  # noqa: F401  (fills the registries)
    from lavis_ds.runners.hooks import LmmsEval

    output_dir = tempfile.mkdtemp(prefix="lavis_ds_lmms_eval_cost_")
    tasks = args.tasks.split(",")
    args.options = [f"run.lmms_eval.tasks=[{','.join(tasks)}]", f"run.lmms_eval.limit={args.requests}",
                    f"run.lmms_eval.batch_size={args.batch_size}", f"run.lmms_eval.include_path={args.include_path}",
                    f"run.lmms_eval.every={10 ** 9}", *args.options]  # the loop's own evaluations: never
    trainer = build_trainer(args, output_dir)
    hook = next(h for h in trainer.hooks if isinstance(h, LmmsEval))
    loader = trainer.data.epoch(0, 0)
    steps = [trainer.data.next_step(loader) for _ in range(min(args.steps, trainer.data.steps_per_epoch))]
    run_step = stepping_as_the_loop(trainer, steps)
    step_times, eval_times = [], []
    for i in range(args.warmup + args.steps):
        comm.barrier()
        start = time.perf_counter()
        run_step(steps[i % len(steps)])
        _synchronize()
        if i >= args.warmup:
            step_times.append(time.perf_counter() - start)
    documents, answers = 0, []
    for _ in range(args.repeats):
        comm.barrier()
        start = time.perf_counter()
        results = hook.run_lmms_eval(trainer)
        _synchronize()
        eval_times.append(time.perf_counter() - start)
        if results is not None:  # rank 0
            documents = sum(int(n.get("effective", 0)) for n in results.get("n-samples", {}).values())
            answers = [s["filtered_resps"][0] for samples in results["samples"].values() for s in samples
                       if isinstance(s["filtered_resps"][0], str)]
    trainer.close()
    shutil.rmtree(output_dir, ignore_errors=True)
    mine = {"step_s": statistics.median(step_times), "eval_s": statistics.median(eval_times)}
    slowest = {key: max(r[key] for r in comm.all_gather_object(mine)) for key in mine}
    if dist.is_main_process():
        _report(args, trainer, slowest, documents, answers)
    return 0


def _report(args, trainer, figures: dict, documents: int, answers: list[str]) -> None:
    step, evaluation = figures["step_s"], figures["eval_s"]
    summary = {**figures, "documents": documents, "eval_s_per_document": evaluation / max(documents, 1),
               "eval_over_step": evaluation / step, "share_every": args.every,
               "share": evaluation / (evaluation + args.every * step), "engine": args.runner,
               "stage": args.stage if args.runner == "runner_deepspeed" else None, "dtype": args.dtype,
               "world_size": trainer.world_size, "global_batch": trainer.plan.global_batch,
               "batch_size": args.batch_size, "tasks": args.tasks, "answers": answers[:4],
               "mean_answer_words": statistics.fmean(len(a.split()) for a in answers) if answers else None}
    engine = f"{args.runner} (ZeRO-{args.stage})" if args.runner == "runner_deepspeed" else args.runner
    print(f"{engine} {args.dtype}, {trainer.world_size} process(es), global batch "
          f"{trainer.plan.global_batch}: step {step * 1e3:.1f} ms (median of {args.steps}); evaluation of "
          f"{documents} documents ({args.tasks}, batch {args.batch_size}) {evaluation:.2f} s "
          f"(median of {args.repeats}), "
          f"{summary['eval_s_per_document'] * 1e3:.1f} ms per document, {summary['eval_over_step']:.1f} steps' worth; "
          f"every {args.every} steps: {summary['share']:.2%} of the wall time; answers such as {answers[:3]}",
          flush=True)
    if args.json:
        args.json.write_text(json.dumps(summary))


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
