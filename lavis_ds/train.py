"""Train (or evaluate) from one YAML.

    lavis-ds train --cfg-path projects/demo/tiny_zero2.yaml [--options run.max_epoch=2 ...]
    torchrun --nproc_per_node=2 --no-python lavis-ds train --cfg-path ...
    python train.py --cfg-path ...                           (the same, as LAVIS users know it)
    torchrun --nproc_per_node=2 train.py --cfg-path ...
    deepspeed --num_gpus 2 train.py --cfg-path ...
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from lavis_ds.common import dist
from lavis_ds.common.errors import InputError
from lavis_ds.common.extensions import configure_build_environment
from lavis_ds.common.logger import show_known_warnings_once


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg-path", required=True, help="run YAML")
    parser.add_argument("--options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. run.init_lr=1e-4 model.freeze_vit=false")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher; LOCAL_RANK in the environment says the same")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Exit codes: 0 done; 2 bad input (config, data, checkpoint, output_dir); 1 a fault while running
    (non-finite loss, another process lost); 143 stopped by SIGTERM (checkpoint saved), 130 by SIGINT."""
    args = parse_args(argv)
    dist.set_single_process_defaults()
    show_known_warnings_once()
    configure_build_environment()  # before anything compiles: one ops folder and one ninja per environment
    from lavis_ds.common.errors import LavisDsError, message_of, report

    try:
        return train(args)
    except LavisDsError as e:  # the message names the file, key, record or step; no traceback helps more
        quiet = getattr(e, "quiet", False) or (e.same_on_every_rank and int(os.environ.get("RANK", 0)) != 0)
        if not quiet:
            report(message_of(e))
        return e.exit_code
    except KeyboardInterrupt:
        report("interrupted: stopped at once, without finishing the step or saving")
        return 130
    except RuntimeError as e:
        from lavis_ds.common.device import deterministic_error

        if (named := deterministic_error(e)) is not None:
            report(message_of(named))
            return 2
        if not _lost_peer(e):
            raise
        report(f"rank {dist.rank()}: lost contact with another process, which failed or was killed "
               f"(its own message, or the launcher's report, says why): {str(e).splitlines()[0]}")
        return 1


def train(args: argparse.Namespace) -> int:
    import lavis_ds  # noqa: F401  (fills the registries)
    from lavis_ds.build import build_trainer
    from lavis_ds.common.device import check_one_gpu_per_process, configure_numerics
    from lavis_ds.config import load_config
    from lavis_ds.common import registry as reg
    from lavis_ds.runners import faults
    from lavis_ds.datasets.loading import ParsedFiles
    from lavis_ds.runners.shared_folder import not_shared_error

    # The annotation files the config check parses are the ones the build uses: each is parsed once.
    parsed_files = ParsedFiles()
    cfg = load_config(args.cfg_path, args.options, world_size=int(os.environ["WORLD_SIZE"]),
                      parsed_files=parsed_files)
    configure_numerics(cfg.run.tf32, cfg.run.deterministic)  # before any kernel runs
    engine_class = reg.engines.get(cfg.run.runner)
    engine_class.setup.prepare_process(cfg)
    engine_class.setup.init_process_group()  # binds this process's GPU first (common.device)
    check_one_gpu_per_process()  # named here, before NCCL would stop at "Duplicate GPU detected"
    lock, error = None, None
    if dist.is_main_process():
        try:
            lock = claim_output_dir(cfg)
        except InputError as e:
            error = e
    try:
        faults.agree(0, error)  # every rank stops if rank 0 could not create or lock the output folder
        faults.agree(0, not_shared_error(Path(cfg.run.output_dir)))  # checkpoints need one folder every node sees
        trainer = build_trainer(cfg, parsed_files)
        del parsed_files  # the datasets hold what they use; the rest (files of unused splits) can go
        if dist.is_main_process():
            # Beside config.yaml: what export and inference need to read the checkpoints (the tokenizer as used).
            trainer.engine.model.save_run_files(cfg.run.output_dir)
        trainer.evaluate_only() if cfg.run.evaluate else trainer.train()
    finally:  # however the run ends; a killed one leaves the file, which the next run takes over
        if lock is not None:
            lock.release()
    return 0


def claim_output_dir(cfg):
    """Create run.output_dir, lock it for this run and write the resolved config.yaml into it; the lock, or an
    InputError saying why that is impossible."""
    from omegaconf import OmegaConf

    from lavis_ds.runners import output_lock

    out, lock = Path(cfg.run.output_dir), None
    if out.exists() and not out.is_dir():
        raise InputError(f"run.output_dir: {out} is a file; give a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = output_lock.acquire(out)  # before config.yaml: a running run's must not be overwritten
        OmegaConf.save(cfg, out / "config.yaml")
        return lock
    except BaseException as e:
        if lock is not None:
            lock.release()
        if isinstance(e, OSError):
            raise InputError(f"run.output_dir: cannot write to {out} ({e.strerror or e}: {e.filename or out}); "
                             "give a folder this user can create and write") from None
        raise


def _lost_peer(error: RuntimeError) -> bool:
    """A collective failed because another rank's process ended (gloo/NCCL report it as a RuntimeError)."""
    import torch.distributed as torch_dist

    text = str(error)
    return isinstance(error, torch_dist.DistError) or any(
        hint in text for hint in ("Connection closed by peer", "Connection reset by peer", "remote worker crashing"))


if __name__ == "__main__":
    dist.exit_now(main())
