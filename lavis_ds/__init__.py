"""lavis_ds: LAVIS-style registry + runner for fine-tuning BLIP2-Qwen with DeepSpeed."""
# Importing each family registers its members: the registries are complete after `import lavis_ds`.
from lavis_ds import datasets, metrics, models, objectives, optim, processors, runners  # noqa: F401
from lavis_ds.common.registry import registry

__all__ = ["registry"]
