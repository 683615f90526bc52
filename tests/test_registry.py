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
    from lavis_ds.common import registry as reg_module
    from lavis_ds.common.registry import registry

    assert registry.get_runner_class("runner_deepspeed").__name__ == "DeepSpeedEngine"
    assert reg_module.runners is reg_module.engines  # LAVIS's name for the registry of engine classes
    assert registry.get_lr_scheduler_class("linear_warmup_cosine_lr").__name__ == "LinearWarmupCosineLR"
    with pytest.raises(KeyError, match="Did you mean 'linear_warmup_step_lr'"):
        registry.get_lr_scheduler_class("linear_warmup_stp_lr")


def test_every_lavis_spelling_is_a_thin_alias_of_a_registry_method():
    """One registry API: each ``registry.register_<kind>`` / ``get_<kind>_class`` is that kind's Registry method."""
    from lavis_ds.common import registry as reg

    lavis = reg.registry
    for kind, registry in [("model", reg.models), ("builder", reg.builders), ("processor", reg.processors),
                           ("lr_scheduler", reg.lr_schedulers), ("engine", reg.engines), ("runner", reg.engines),
                           ("metric", reg.metrics), ("hook", reg.hooks)]:
        assert getattr(lavis, f"get_{kind}_class") == registry.get
        assert getattr(lavis, f"register_{kind}").__self__ is registry


def test_one_did_you_mean_serves_every_suggestion():
    """difflib is called in one place (common/suggest.py): registries, sections and settings suggest alike."""
    from pathlib import Path

    from lavis_ds.common.suggest import did_you_mean

    package = Path(__file__).resolve().parent.parent / "lavis_ds"
    callers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "difflib" in p.read_text())
    assert callers == ["common/suggest.py"]
    assert did_you_mean("stag", ["stage", "offload"]) == "did you mean 'stage'?"
    assert did_you_mean("qwn2", ["qwen2", "qwen3", "llama"], n=2) == "did you mean 'qwen2', 'qwen3'?"
    assert did_you_mean("zzz", ["stage"], "valid keys: stage") == "valid keys: stage"
    r = Registry("widget")
    r.register("MyModel")(type("A", (), {}))
    with pytest.raises(KeyError, match=r"Unknown widget 'MyModl'\. Did you mean 'MyModel'\?"):  # its own spelling
        r.get("MyModl")
