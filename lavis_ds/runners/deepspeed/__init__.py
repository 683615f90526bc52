"""runner_deepspeed: the DeepSpeed ZeRO engine behind the shared loop, and everything only it needs.

``engine`` (the engine and its config part), ``section`` (``run.deepspeed_config``: JSON files, "auto" values,
DeepSpeed's own checks), ``zero_keys`` (``run.zero_stage`` and the offload run keys, and their spelling in that
JSON), ``placement`` (ZeRO-3: the LLM built partitioned from the start), ``checkpoint`` (DeepSpeed's checkpoint
files, its universal form, trained weights for export: the engine's checkpoints part),
``ops`` (compiling DeepSpeed's CPU ops once per environment) and ``adam_counter`` (CPU Adam's step counter).
"""
from lavis_ds.runners.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
