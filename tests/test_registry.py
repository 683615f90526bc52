import pytest

from lavis_ds.common.registry import Registry


def test_register_and_get():
    r = Registry("widget")

    @r.register("round")
    class Round:
        pass

    assert r.get("round") is Round
    assert "round" in r and list(r) == ["round"] and len(r) == 1
    assert "round" in repr(r)


def test_unknown_name_lists_known_and_suggests_closest():
    r = Registry("widget")
    r.register("blip2_qwen")(type("A", (), {}))
    r.register("eva_vit_g")(type("B", (), {}))
    with pytest.raises(KeyError, match=r"Unknown widget 'blip2_qwn'\. Did you mean 'blip2_qwen'\? Known widgets: blip2_qwen, eva_vit_g"):
        r.get("blip2_qwn")


def test_duplicate_name_names_first_owner():
    r = Registry("widget")

    class First:
        pass

    r.register("x")(First)
    with pytest.raises(KeyError, match=r"'x' is already registered by .*test_registry\..*First"):
        r.register("x")(type("Second", (), {}))


def test_lavis_spelling_reaches_the_global_registries():
    import lavis_ds  # noqa: F401
    from lavis_ds.common.registry import registry

    assert registry.get_runner_class("runner_deepspeed").__name__ == "DeepSpeedEngine"
    assert registry.get_lr_scheduler_class("linear_warmup_cosine_lr").__name__ == "LinearWarmupCosineLR"
    with pytest.raises(KeyError, match="Did you mean 'linear_warmup_step_lr'"):
        registry.get_lr_scheduler_class("linear_warmup_stp_lr")
