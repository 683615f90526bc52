"""MiniGPT4Qwen / LAVIS YAMLs, user subclasses and Hugging Face DeepSpeed configs, as their users have them.

The MiniGPT4Qwen YAMLs under tests/fixtures/minigpt4qwen/ are verbatim copies of Coobiw/MPP-LLaVA's
published run files (tests/fixtures/SOURCES.md), instruction_tuning/train.yaml in both of its published
spellings (run.autocast_dtype, then model.autocast_dtype); only paths, sizes and the Qwen-1 model_type are
substituted (through --options, as a user would), never their LAVIS keys.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import lavis_ds  # noqa: F401
from lavis_ds.config import ConfigError, load_config
from lavis_ds.common.registry import Registry, registry
from lavis_ds.common.schema import fields_of
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from lavis_ds.models import Blip2Qwen
from run_utils import run_train, tiny_config, train_steps, write_yaml

FIXTURES = Path(__file__).parent / "fixtures"
MINIGPT4QWEN = sorted((FIXTURES / "minigpt4qwen").glob("*.yaml"))


def _problems(path, options=(), world_size=1, check_files=False):
    with pytest.raises(ConfigError) as info:
        load_config(path, options, world_size=world_size, check_files=check_files)
    return info.value.problems


# ----------------------------------------------------------------------------------------------- registry


def test_alias_resolves_to_the_same_class_and_shows_as_an_alias():
    r = Registry("widget")
    cls = r.register("round")(type("Round", (), {}))
    r.register_alias("circle", "round")
    assert r.get("circle") is cls and "circle" in r and r.canonical("circle") == "round"
    assert list(r) == ["round"] and len(r) == 1  # not a second entry
    assert "circle -> round" in repr(r)
    with pytest.raises(KeyError, match=r"Did you mean 'circle'\?.*circle \(= round\)"):
        r.get("circl")


def test_alias_duplicates_are_refused_both_ways():
    r = Registry("widget")
    r.register("round")(type("Round", (), {}))
    r.register_alias("circle", "round")
    with pytest.raises(KeyError, match="'circle' is already an alias of 'round'"):
        r.register("circle")(type("Circle", (), {}))
    with pytest.raises(KeyError, match="'round' is already registered by"):
        r.register_alias("round", "round")
    with pytest.raises(KeyError, match="no widget is registered as 'square'"):
        r.register_alias("box", "square")


def test_minigpt4qwen_names_are_registered_aliases():
    assert registry.get_model_class("minigpt4qwen") is Blip2Qwen
    assert registry.get_runner_class("deepspeed_runner") is registry.get_runner_class("runner_deepspeed")
    # MPP-LLaVA's two builders both read its InstructionDataset (the instruction JSON): SOURCES.md.
    for name in ("minigpt4_instruction", "llava_instruction"):
        assert registry.get_builder_class(name) is registry.get_builder_class("minigpt4qwen_instruction")


# ------------------------------------------------------------------------------ published YAMLs, in process


@pytest.mark.parametrize("path", MINIGPT4QWEN, ids=[p.name for p in MINIGPT4QWEN])
def test_published_yaml_is_refused_only_for_its_qwen1_model_type(path):
    problems = _problems(path, world_size=4)
    assert len(problems) == 1, problems
    assert problems[0].startswith("model.model_type: model_type 'qwen")
    assert "Qwen-1" in problems[0] and "'qwen2.5_7b_instruct'" in problems[0] and "qwen2.5_1.5b_instruct" in problems[0]


@pytest.mark.parametrize("path", MINIGPT4QWEN, ids=[p.name for p in MINIGPT4QWEN])
def test_published_yaml_loads_with_a_qwen2_preset_and_names_ignored_keys_once(path, caplog):
    with caplog.at_level(logging.WARNING, logger="lavis_ds"):
        cfg = load_config(path, ["model.model_type=qwen2.5_7b_instruct"], world_size=4, check_files=False)
    ignored = [r.getMessage() for r in caplog.records if "change nothing" in r.getMessage()]
    assert len(ignored) == 1 and "model.load_finetuned" in ignored[0] and "model.qformer_text_input" in ignored[0]
    assert cfg.model.arch == "minigpt4qwen" and "load_finetuned" not in cfg.model
    assert cfg.run.deepspeed_config.bf16.enabled is True
    ds = cfg.run.deepspeed_config
    assert ds.train_batch_size == ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * 4


@pytest.mark.parametrize("arch, refused", [("instructblip", False), ("minigpt4qwen", True)])
def test_qformer_text_input_is_refused_only_where_the_q_former_reads_the_image_alone(arch, refused):
    from lavis_ds.common.lavis_compat import translate

    problems, notes = translate({"model": {"arch": arch, "qformer_text_input": True}})
    assert bool(problems) is refused and ("model.qformer_text_input" in "".join(notes)) is not refused
    if refused:
        assert re.match(r"model\.qformer_text_input: True: .*use model\.arch: instructblip$", problems[0])


def test_instruction_tuning_yaml_maps_every_lavis_run_key():
    cfg = load_config(FIXTURES / "minigpt4qwen" / "instruction_tuning_train.yaml",
                      ["model.model_type=qwen2.5_7b_instruct"], world_size=1, check_files=False)
    ds = cfg.run.deepspeed_config
    # batch_size_train: 1, accum_grad_iters: 16 -> a global batch of 16 (was silently 1 before)
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps, ds.train_batch_size) == (1, 16, 16)
    assert ds.gradient_clipping == 1.0  # grad_norm_clip
    assert ds.bf16.enabled is True  # model.autocast_dtype: bfloat16 (amp: False means no fp16 GradScaler)
    assert dict(cfg.run.generate) == {"max_new_tokens": 100, "min_new_tokens": 1, "num_beams": 5}
    # accum_grad_iters and grad_norm_clip are lavis_ds's engine-neutral keys too; the rest were mapped or dropped
    assert (cfg.run.accum_grad_iters, cfg.run.grad_norm_clip, cfg.run.precision) == (16, 1.0, "bf16")
    for key in ("amp", "resume_ckpt_path", "device"):
        assert key not in cfg.run
    # MiniGPT4Qwen's task name is kept: an alias of next-token SFT in the objective registry
    assert registry.get_task_class(cfg.run.task) is registry.get_objective_class("sft")
    assert "fsdp" not in cfg.run  # LAVIS's `fsdp: False`, dropped; the key is runner_fsdp's options section here


def test_lavis_key_conflicting_with_its_deepspeed_key_names_both():
    problems = _problems(FIXTURES / "minigpt4qwen" / "instruction_tuning_train.yaml",
                         ["model.model_type=qwen2.5_7b_instruct", "run.deepspeed_config.gradient_accumulation_steps=4",
                          "run.deepspeed_config.fp16.enabled=true"])
    assert any("run.accum_grad_iters=16 and run.deepspeed_config.gradient_accumulation_steps=4 disagree" in p
               for p in problems), problems
    assert any("model.autocast_dtype='bfloat16' means bf16 but run.deepspeed_config.fp16.enabled is True" in p
               for p in problems), problems


def test_early_instruction_tuning_yaml_maps_amp_with_its_run_autocast_dtype():
    """The earlier published spelling: run.amp switches autocast on, run.autocast_dtype says its dtype,
    run.loss_scale switches the GradScaler (off: bf16 needs none)."""
    cfg = load_config(FIXTURES / "minigpt4qwen" / "instruction_tuning_train_run_autocast.yaml",
                      ["model.model_type=qwen2.5_7b_instruct"], world_size=1, check_files=False)
    ds = cfg.run.deepspeed_config
    assert cfg.run.precision == "bf16" and ds.bf16.enabled is True and "fp16" not in ds
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps, ds.gradient_clipping) == (1, 16, 1.0)
    for key in ("amp", "autocast_dtype", "loss_scale"):
        assert key not in cfg.run


@pytest.mark.parametrize("options, precision", [
    (["run.amp=false"], "fp32"),  # MiniGPT4Qwen made no autocast without amp: autocast_dtype was never read
    (["run.autocast_dtype=fp16", "run.loss_scale=true"], "fp16"),
    (["run.autocast_dtype=null", "run.loss_scale=null"], "fp16"),  # its runner's default autocast dtype
    (["model.autocast_dtype=bfloat16"], "bf16"),  # both spellings, agreeing
])
def test_early_spelling_means_what_minigpt4qwen_ran(options, precision):
    cfg = load_config(FIXTURES / "minigpt4qwen" / "instruction_tuning_train_run_autocast.yaml",
                      ["model.model_type=qwen2.5_7b_instruct", *options], world_size=1, check_files=False)
    assert cfg.run.precision == precision


@pytest.mark.parametrize("options, message", [
    (["run.autocast_dtype=fp16"], r"^run\.loss_scale: False with fp16 \(run\.amp=True with run\.autocast_dtype='fp16'\)"
                                  r": fp16 training here always scales the loss"),
    (["model.autocast_dtype=fp16"], r"^model\.autocast_dtype='fp16' and run\.autocast_dtype='bf16' disagree"),
    (["run.loss_scale=sometimes"], r"^run\.loss_scale: expected true or false, got 'sometimes'$"),
    (["run.autocast_dtype=float8"], r"^run\.autocast_dtype: 'float8' is not a dtype; valid: bfloat16, "),
])
def test_early_spelling_that_cannot_run_as_written_is_one_problem(options, message):
    problems = _problems(FIXTURES / "minigpt4qwen" / "instruction_tuning_train_run_autocast.yaml",
                         ["model.model_type=qwen2.5_7b_instruct", *options])
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_amp_alone_means_lavis_fp16(tmp_path):
    src = yaml.safe_load((FIXTURES / "minigpt4qwen" / "instruction_tuning_train.yaml").read_text())
    del src["model"]["autocast_dtype"]
    src["run"]["amp"] = True
    cfg = load_config(write_yaml(tmp_path / "amp.yaml", src), ["model.model_type=qwen2.5_7b_instruct"],
                      check_files=False)
    assert cfg.run.deepspeed_config.fp16.enabled is True and "bf16" not in cfg.run.deepspeed_config


# ----------------------------------------------------------------------------------- errors in one round


def test_unknown_arch_model_type_builder_and_engine_come_with_every_other_problem():
    problems = _problems(FIXTURES / "minigpt4qwen" / "train_zero2_3090x4.yaml", [
        "model.arch=minigpt4qwn", "model.frezee_vit=true", "datasets.llava_instruction.builder=llava_instrucion",
        "datasets.llava_instruction.skip_bad_record=true", "run.runner=deepspeed_runer", "run.max_epoc=2",
        "run.deepspeed_config.zero_optimization.stag=2"], world_size=4)
    text = "\n".join(problems)
    assert "model.arch: Unknown model 'minigpt4qwn'. Did you mean 'minigpt4qwen'?" in text
    assert "model.model_type: model_type 'qwen7b_chat' is not supported" in text  # checked against the closest arch
    assert "model.frezee_vit: unknown key; did you mean 'freeze_vit'?" in text
    assert "datasets.llava_instruction: Unknown dataset builder 'llava_instrucion'" in text
    assert "datasets.llava_instruction.skip_bad_record: unknown key; did you mean 'skip_bad_records'?" in text
    assert "run.runner: Unknown engine 'deepspeed_runer'. Did you mean 'deepspeed_runner'?" in text
    assert "run.max_epoc: unknown key; did you mean 'max_epoch'?" in text
    assert "run.deepspeed_config.zero_optimization.stag: unknown key; did you mean 'stage'?" in text
    assert len(problems) == 8, problems


def test_unknown_model_type_still_checks_the_model_keys(tmp_path):
    problems = _problems(FIXTURES / "minigpt4qwen" / "train_zero2_3090x4.yaml",
                         ["model.model_type=qwen2.5_7b_instrct", "model.lora_rr=4"], world_size=4)
    assert len(problems) == 2, problems
    assert "Did you mean 'qwen2.5_7b_instruct'?" in problems[0]
    assert "model.lora_rr: unknown key; did you mean 'lora_r'?" in problems[1]


# -------------------------------------------------------------------------------------- subclass schemas


class _ForwardingBlip2(Blip2Qwen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


class _ExtendingBlip2(Blip2Qwen):
    def __init__(self, *, extra_scale: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.extra_scale = extra_scale


def test_schema_follows_forwarded_kwargs_up_the_mro():
    parent = fields_of(Blip2Qwen)
    assert fields_of(_ForwardingBlip2) == parent
    extended = fields_of(_ExtendingBlip2)
    assert set(extended) == set(parent) | {"extra_scale"} and extended["extra_scale"] == (float, 1.0)


def test_processor_and_builder_subclasses_keep_their_parents_keys():
    from lavis_ds.datasets.builders import InstructionBuilder
    from lavis_ds.processors.base import constructor_keys
    from lavis_ds.processors.image import Blip2ImageTrainProcessor

    class MyProcessor(Blip2ImageTrainProcessor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    assert constructor_keys(MyProcessor) == constructor_keys(Blip2ImageTrainProcessor)
    assert "image_size" in constructor_keys(MyProcessor)
    MyProcessor.from_config({"name": "x", "image_size": 32})

    class MyBuilder(InstructionBuilder):  # unregistered: the defaults of its registered parent
        pass

    assert MyBuilder.default_config() == InstructionBuilder.default_config()


USER_SUBCLASS = '''
from lavis_ds.common.registry import registry
from lavis_ds.models import Blip2Qwen


@registry.register_model("my_blip2")
class MyBlip2(Blip2Qwen):
    PRETRAINED_MODEL_CONFIG_DICT = Blip2Qwen.PRETRAINED_MODEL_CONFIG_DICT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
'''


def test_user_subclass_registered_through_imports_trains(tmp_path):
    pkg = tmp_path / "my_ext"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(USER_SUBCLASS))
    storage = tmp_path / "demo"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=16, num_val=8, num_test=8))
    cfg = tiny_config(tmp_path / "out", storage, stage=1, micro=4, warmup_steps=0)
    cfg["imports"] = ["my_ext.model"]
    cfg["model"].update(arch="my_blip2", freeze_vit=True)  # a parent key, reached through **kwargs
    run_train(write_yaml(tmp_path / "sub.yaml", cfg), nproc=0, cwd=tmp_path)
    steps = train_steps(tmp_path / "out")
    assert [m["step"] for m in steps] == [1, 2, 3, 4]  # 16 samples / micro-batch 4 on one process
    assert "arch: my_blip2" in (tmp_path / "out" / "config.yaml").read_text()


# --------------------------------------------------------------------------- Hugging Face DeepSpeed configs


def _demo_run(tmp_path, **run):
    storage = tmp_path / "demo"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=16, num_val=8, num_test=8))
    # the JSON's "auto" clipping: DeepSpeed's default; its ZeRO stage: the JSON's
    return tiny_config(tmp_path / "out", storage, stage=None if "deepspeed_config" in run else 2, clip=None, **run)


def test_hf_ds_config_file_with_autos_is_filled_from_the_run(tmp_path, monkeypatch, caplog):
    shutil.copy(FIXTURES / "deepspeed" / "hf_ds_config_zero2.json", tmp_path / "ds.json")
    monkeypatch.chdir(tmp_path)  # relative to the working directory
    cfg = _demo_run(tmp_path, deepspeed_config="ds.json", batch_size_train=4, init_lr=3e-4, weight_decay=0.01)
    with caplog.at_level(logging.WARNING, logger="lavis_ds"):
        loaded = load_config(write_yaml(tmp_path / "hf.yaml", cfg), world_size=2)
    ds = loaded.run.deepspeed_config
    assert ds.train_micro_batch_size_per_gpu == 4 and ds.gradient_accumulation_steps == 1 and ds.train_batch_size == 8
    assert dict(ds.optimizer.params) == {"lr": 3e-4, "weight_decay": 0.01}  # betas/eps "auto": AdamW's defaults
    assert ds.fp16.enabled is False and ds.bf16.enabled is False and "gradient_clipping" not in ds
    assert "scheduler" not in ds and ds.zero_optimization.stage == 2
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "run.deepspeed_config.scheduler: dropped (WarmupLR" in messages
    assert "optimizer.params.lr = run.init_lr (0.0003)" in messages
    assert "left to DeepSpeed's defaults: optimizer.params.betas, optimizer.params.eps, gradient_clipping" in messages


def test_ds_config_file_missing_or_not_json_is_named(tmp_path):
    (tmp_path / "bad.json").write_text("{\"zero_optimization\": {\"stage\": 2,}")
    for name, message in (("absent.json", "DeepSpeed JSON file 'absent.json' not found"),
                          (str(tmp_path / "bad.json"), f"{tmp_path / 'bad.json'} is not valid JSON")):
        cfg = _demo_run(tmp_path, deepspeed_config=name, batch_size_train=4)
        problems = _problems(write_yaml(tmp_path / "x.yaml", cfg))
        assert any(p.startswith("run.deepspeed_config:") and message in p for p in problems), problems


def test_scheduler_with_real_values_and_conflicting_lr_are_errors(tmp_path):
    hf = json.loads((FIXTURES / "deepspeed" / "hf_ds_config_zero2.json").read_text())
    hf["scheduler"]["params"]["warmup_num_steps"] = 100
    hf["optimizer"]["params"]["lr"] = 1e-3
    (tmp_path / "ds.json").write_text(json.dumps(hf))
    cfg = _demo_run(tmp_path, deepspeed_config=str(tmp_path / "ds.json"), batch_size_train=4, init_lr=1e-4)
    problems = _problems(write_yaml(tmp_path / "x.yaml", cfg))
    assert any(p.startswith("run.deepspeed_config.scheduler: lavis_ds steps the learning rate itself") for p in problems)
    assert any("run.deepspeed_config.optimizer.params.lr=0.001 and run.init_lr=0.0001 disagree" in p for p in problems)


def test_config_yaml_holds_the_deepspeed_section_as_handed_to_deepspeed(tmp_path):
    cfg = _demo_run(tmp_path)
    loaded = load_config(write_yaml(tmp_path / "x.yaml", cfg), world_size=2)
    from lavis_ds.runners.deepspeed.section import build_deepspeed_config
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(loaded.run.deepspeed_config) == build_deepspeed_config(
        OmegaConf.to_container(loaded.run), 2)
    assert loaded.run.deepspeed_config.train_batch_size == 8


# ------------------------------------------------------------------- a published YAML through train.py


@pytest.mark.parametrize("published", ["instruction_tuning_train.yaml", "instruction_tuning_train_run_autocast.yaml"])
def test_instruction_tuning_yaml_trains_with_its_batch_and_precision(tmp_path, published):
    """MiniGPT4Qwen's instruction_tuning/train.yaml in both published spellings, paths and sizes substituted:
    batch_size_train 1 x accum_grad_iters 16 on one process = 16 per optimizer step; bf16 (model.autocast_dtype
    bfloat16, or run.amp with run.autocast_dtype bf16) = a bf16 engine."""
    storage = tmp_path / "demo"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=32, num_val=8, num_test=8))
    yaml_path = shutil.copy(FIXTURES / "minigpt4qwen" / published, tmp_path / "train.yaml")
    data = [f"datasets.{name}.{key}" for name in ("minigpt4_instruction", "llava_instruction") for key in (
        f"build_info.annotations.train.storage={storage}/annotations/train.json",
        f"build_info.images.storage={storage}/images", "vis_processor.train.image_size=64",
        "vis_processor.eval.image_size=64")]
    options = ("model.model_type=tiny", "model.vit_model=tiny", "model.image_size=64", "model.num_query_token=8",
               "model.llm_model=null", "model.load_pretrained=false", "model.pretrained=null",
               "model.use_grad_checkpoint=false", "model.vit_precision=fp32", f"model.tokenizer={storage}/tokenizer",
               "model.max_txt_len=96", *data, f"run.output_dir={tmp_path / 'out'}", "run.max_epoch=1",
               "run.num_workers=0", "run.warmup_steps=1", "run.log_freq=1",
               "run.runner=deepspeed_runner")  # the zero*_3090x4 YAMLs' runner name, resolved by its alias
    proc = run_train(Path(yaml_path), nproc=0, cwd=tmp_path, options=options)
    steps = train_steps(tmp_path / "out")
    assert [m["step"] for m in steps] == [1, 2, 3, 4], steps  # 2 x 32 samples / (1 x 16 x 1 process)
    written = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    ds = written["run"]["deepspeed_config"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (1, 16, 16)
    assert ds["bf16"]["enabled"] is True and ds["gradient_clipping"] == 1.0
    states = next((tmp_path / "out").rglob("mp_rank_00_model_states.pt"))
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert module["connector.llm_proj.weight"].dtype == torch.bfloat16  # the engine ran in bf16
    assert proc.stderr.count("change nothing in lavis_ds, ignored") == 1


def test_file_problems_come_with_structural_ones(tmp_path):
    """A missing annotation file is reported in the same round as a typo elsewhere."""
    problems = _problems(FIXTURES / "minigpt4qwen" / "instruction_tuning_train.yaml", [
        "model.model_type=qwen2.5_7b_instruct", "run.max_epoc=2",
        f"datasets.minigpt4_instruction.build_info.annotations.train.storage={tmp_path}/absent.json",
        f"datasets.minigpt4_instruction.build_info.images.storage={tmp_path}"], check_files=True)
    text = "\n".join(problems)
    assert "run.max_epoc: unknown key; did you mean 'max_epoch'?" in text
    assert (f"datasets.minigpt4_instruction.build_info.annotations.train.storage: annotation file {tmp_path}/absent.json "
            "does not exist") in text
    assert "datasets.llava_instruction.build_info.annotations: required" in text
    assert "model.llm_model: 'ckpt/Qwen7B-chat' does not exist" in text


def test_engine_subclass_forwarding_its_arguments_is_a_valid_engine(tmp_path):
    from lavis_ds.runners import DeepSpeedEngine

    @registry.register_runner("test_compat_forwarding_engine")  # LAVIS's spelling of register_engine
    class ForwardingEngine(DeepSpeedEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    cfg = _demo_run(tmp_path, runner="test_compat_forwarding_engine")
    assert load_config(write_yaml(tmp_path / "x.yaml", cfg)).run.runner == "test_compat_forwarding_engine"


@pytest.mark.parametrize("given, resume", [
    ({"resume_ckpt_load_dir": "out/checkpoints", "resume_ckpt_tag": "step_4"}, "out/checkpoints/step_4"),
    ({"resume_ckpt_load_dir": "out/checkpoints", "resume_ckpt_tag": None}, "out/checkpoints"),
    ({"resume_ckpt_load_dir": None, "resume_ckpt_tag": None}, None),
])
def test_minigpt4qwen_resume_folder_and_tag_are_translated_into_run_resume(given, resume):
    from lavis_ds.common import lavis_compat

    cfg = {"run": dict(given)}
    problems, notes = lavis_compat.translate(cfg)
    assert problems == [] and cfg["run"].get("resume") == resume
    assert not {"resume_ckpt_load_dir", "resume_ckpt_tag"} & set(cfg["run"])  # no key of its own left
    assert any("-> run.resume" in note for note in notes) == (resume is not None)


@pytest.mark.parametrize("given, message", [
    ({"resume_ckpt_tag": "step_4"}, r"run\.resume_ckpt_tag='step_4' names a checkpoint inside "
                                    r"run\.resume_ckpt_load_dir, which is not set"),
    ({"resume_ckpt_load_dir": "a", "resume": "b"}, r"run\.resume_ckpt_load_dir='a' and run\.resume='b' disagree"),
])
def test_minigpt4qwen_resume_folder_that_cannot_be_translated_is_named(given, message):
    from lavis_ds.common import lavis_compat

    problems, _ = lavis_compat.translate({"run": dict(given)})
    assert len(problems) == 1 and re.search(message, problems[0]), problems
