"""What a ``model:`` section means, read without building the model: one settings class per architecture family
(``base.ModelSettings`` for any model, ``vision_llm``, ``composed``, ``blip2_qwen``, ``qwen_vl``, ``qwen3_vl``), named
by each model class in ``SETTINGS`` and asked through ``base.model_settings(arch_cls, section)``.

This package imports no architecture class (the architectures import their settings classes), so its modules are
imported by name, not from here."""
