"""Tiny run configs of the real code paths: the tiny BLIP2-Qwen on demo_shapes copies."""
from __future__ import annotations

import json
from pathlib import Path

import yaml


def tiny_config(output_dir: Path, demo_storage: Path, stage: int | None = 2, dtype: str = "fp32", micro: int = 4,
                accum: int = 1, max_epoch: int = 1, clip: float | None = 1.0, sizes: tuple[int, int, int] | None = None,
                **run) -> dict:
    """A run of the tiny BLIP2-Qwen on a small demo_shapes copy, logging every step. ``stage``: run.zero_stage
    (None: unset, for a DeepSpeed section in ``run`` to give it);
    ``clip``: run.grad_norm_clip (None: unset); ``sizes``: the demo's (num_train, num_val, num_test), by default
    what ``demo_storage`` holds (its DONE file), or (128, 16, 8) for data the build is yet to generate;
    ``run``: more run keys."""
    done = Path(demo_storage) / "DONE"
    if sizes is None:
        spec = json.loads(done.read_text()) if done.is_file() else {"num_train": 128, "num_val": 16, "num_test": 8}
        sizes = (spec["num_train"], spec["num_val"], spec["num_test"])
    return {
        "model": {"arch": "blip2_qwen", "model_type": "tiny", "tokenizer": f"{demo_storage}/tokenizer"},
        "datasets": {"demo_shapes": {"build_info": {"storage": str(demo_storage), **dict(zip(
            ("num_train", "num_val", "num_test"), sizes))}}},
        "run": {
            "output_dir": str(output_dir), "init_lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 2,
            "max_epoch": max_epoch, "log_freq": 1, "seed": 7, "batch_size_eval": 8,
            "batch_size_train": micro, "accum_grad_iters": accum, "precision": dtype,
            **({} if clip is None else {"grad_norm_clip": clip}),
            **({} if stage is None else {"zero_stage": stage}),
            **run,
        },
    }


# The resumption runs: 64 samples, micro 4 x accumulation 2 x 2 processes, 3 epochs, a checkpoint every 3 steps.
STEPS_PER_EPOCH = 64 // (4 * 2 * 2)
EPOCHS = 3
SAVE_EVERY = 3


def noisy_config(out: Path, demo_storage: Path, stage: int, dtype: str, micro: int = 4, accum: int = 2,
                 **run) -> dict:
    """Random crops and flips (the demo's train processor), dropout and stochastic depth all on."""
    cfg = tiny_config(out, demo_storage, stage=stage, dtype=dtype, micro=micro, accum=accum, max_epoch=EPOCHS,
                      save_freq_steps=SAVE_EVERY, **run)
    cfg["datasets"]["demo_shapes"]["build_info"]["num_train"] = 64
    cfg["model"].update(drop_path_rate=0.1, llm_config={"attention_dropout": 0.1},
                        qformer={"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})
    return cfg


def write_yaml(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
