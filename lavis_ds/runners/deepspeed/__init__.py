"""runner_deepspeed: DeepSpeed ZeRO behind the shared loop, and everything only it needs.

``runner`` (the engine), ``section`` (``run.deepspeed_config``: JSON files, "auto" values, DeepSpeed's own
checks), ``placement`` (ZeRO-3: the LLM built partitioned from the start), ``checkpoint`` (DeepSpeed's
checkpoint files, its universal form, trained weights for export),
``ops`` (compiling DeepSpeed's CPU ops once per environment) and ``adam_counter`` (CPU Adam's step counter).
"""
from lavis_ds.runners.deepspeed.runner import DeepSpeedRunner

__all__ = ["DeepSpeedRunner"]
