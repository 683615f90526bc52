"""lavis_ds: LAVIS-style registry + trainer for fine-tuning multimodal LLMs built from parts (a vision tower, a
connector, a chat LLM) with DeepSpeed ZeRO or PyTorch FSDP2."""
# Importing each family registers its members: the registries are complete after `import lavis_ds`.
from lavis_ds import datasets, metrics, models, objectives, optim, processors, runners  # noqa: F401
from lavis_ds.common.registry import registry

__all__ = ["registry"]
