"""The transformers vision-LLM classes lavis_ds exports to and reads published folders of, one registered family
each (``registry.hf_families``; the record: ``lavis_ds.models.hf.family.HfFamily``). Importing this package
registers them; a new family is one module here, imported below."""
from lavis_ds.models.hf import blip, llava, qwen3_5, qwen3_vl, qwen_vl
from lavis_ds.models.hf.family import HfFamily

__all__ = ["HfFamily", "blip", "llava", "qwen3_5", "qwen3_vl", "qwen_vl"]
