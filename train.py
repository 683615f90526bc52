"""Train (or evaluate) from one YAML.

    python train.py --cfg-path projects/demo/tiny_zero2.yaml [--options run.max_epoch=2 ...]
    torchrun --nproc_per_node=2 train.py --cfg-path ...
    deepspeed --num_gpus 2 train.py --cfg-path ...
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lavis_ds.common import dist
from lavis_ds.common.logger import show_known_warnings_once
from lavis_ds.common.extensions import configure_build_environment


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg-path", required=True, help="run YAML")
    parser.add_argument("--options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. run.init_lr=1e-4 model.freeze_vit=false")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher; LOCAL_RANK in the environment says the same")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.set_single_process_defaults()
    show_known_warnings_once()
    configure_build_environment()  # before anything compiles: one ops folder and one ninja per environment

    import lavis_ds  # noqa: F401  (fills the registries)
    from lavis_ds.build import build_runner
    from lavis_ds.common.config import ConfigError, load_config
    from lavis_ds.common.registry import registry

    try:
        cfg = load_config(args.cfg_path, args.options, world_size=int(os.environ["WORLD_SIZE"]))
    except ConfigError as e:
        print(f"lavis_ds: {e}", file=sys.stderr)
        return 2

    registry.get_runner_class(cfg.run.runner).prepare_process(cfg)
    dist.init_distributed()
    if dist.is_main_process():
        from omegaconf import OmegaConf

        Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, Path(cfg.run.output_dir) / "config.yaml")
    try:
        runner = build_runner(cfg)
    except ConfigError as e:  # found when building, e.g. a resume on a world size that cannot keep the batch
        print(f"lavis_ds: {e}", file=sys.stderr)
        return 2
    if dist.is_main_process():
        # Beside config.yaml: what export and inference need to read the checkpoints (the tokenizer as used).
        runner.module.save_run_files(cfg.run.output_dir)
    runner.evaluate_only() if cfg.run.evaluate else runner.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
