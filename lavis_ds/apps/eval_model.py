"""lmms-eval's ``--model lavis_ds --model_args pretrained=PATH``: a lavis_ds model loaded from a run or an export.

``PretrainedLavisDsLmms`` is the class the ``lmms_eval.models`` entry point names (pyproject.toml,
:func:`manifest`). It loads what ``pretrained`` names the way ``lavis-ds export``/``generate`` read it
(``export_io.load_trained``: an export folder, a checkpoint folder, or a run's output_dir and its newest complete
checkpoint) with the run's eval processors (``image_config.eval_processors_of``), and evaluates it as
``lavis_ds.runners.lmms_eval.model.LavisDsLmms`` evaluates the trainer's live model. Imports lmms-eval.
"""
from __future__ import annotations

import os
from typing import Any

from lavis_ds.apps.export_io import load_trained
from lavis_ds.common.errors import InputError
from lavis_ds.image_config import eval_processors_of
from lavis_ds.runners.lmms_eval.model import LavisDsLmms
from lavis_ds.runners.lmms_eval.requests import GENERATE_KEYS

MODEL_NAME = "lavis_ds"  # the name lmms-eval knows the class by (--model lavis_ds)
MODEL_ARGS = ("pretrained", "device", "dtype", "batch_size", "max_frames", *GENERATE_KEYS)


class PretrainedLavisDsLmms(LavisDsLmms):
    """``LavisDsLmms`` built from ``--model_args`` (see :meth:`from_pretrained`)."""

    @classmethod
    def from_pretrained(cls, pretrained: str, device: str = "cpu", dtype: str = "auto", batch_size: int = 1,
                        max_frames: int | None = None, hold_failures: bool = False, agree_per_call: bool = False,
                        **generation: Any) -> "PretrainedLavisDsLmms":
        """Args:
            pretrained: An export folder, a checkpoint folder (``<output_dir>/checkpoints/step_<N>``: the best one,
                or any) or a run's output_dir (its newest complete checkpoint).
            device, dtype: Where and in which dtype to run (``auto``: the dtype it trained in).
            batch_size: Requests per call. ``max_frames``: frames sampled from a video request.
            hold_failures: Keep a request this rank cannot prepare as ``failure`` (``LavisDsLmms``), for the caller
                to raise once lmms-eval is done: ``lavis-ds eval`` on several processes.
            agree_per_call: End each request method with the ranks' agreement on whether it failed on any, every
                rank raising if so (``LavisDsLmms``): lmms-eval's own command line on several processes.
            generation: Default generation settings (``max_new_tokens``, ``num_beams``, ...), under the task's.
        """
        model, cfg = load_trained(pretrained, device=device, dtype=dtype)
        image_processor, text_processor = eval_processors_of(cfg)
        extra = {} if max_frames is None else {"max_frames": int(max_frames)}
        return cls(model, image_processor, text_processor, batch_size=int(batch_size), generation=generation,
                   hold_failures=hold_failures, agree_per_call=agree_per_call, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "PretrainedLavisDsLmms":
        """lmms-eval's ``--model_args`` (``pretrained=PATH,max_new_tokens=16``), its ``--batch_size`` and
        ``--device``. On several processes each request method ends with the ranks' agreement on its failures
        (``agree_per_call``): lmms-eval's command line catches an evaluation's error on each rank and exits 0, so a
        rank failing alone would leave the others in lmms-eval's next gather for good."""
        from lmms_eval import utils

        args = {**utils.simple_parse_args_string(arg_string),
                **{k: v for k, v in (additional_config or {}).items() if v is not None and k in MODEL_ARGS}}
        unknown = sorted(set(args) - set(MODEL_ARGS))
        if unknown or "pretrained" not in args:
            problem = f"unknown {', '.join(unknown)}" if unknown else "pretrained=PATH is missing"
            raise InputError(f"--model_args for {MODEL_NAME}: {problem}; it takes {', '.join(MODEL_ARGS)}")
        return cls.from_pretrained(**args, agree_per_call=int(os.environ.get("WORLD_SIZE", "1")) > 1)


def manifest():
    """The ``lmms_eval.models`` entry point's payload: lmms-eval's name for the class and where it lives."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_NAME, simple_class_path=f"{__name__}.{PretrainedLavisDsLmms.__name__}")
