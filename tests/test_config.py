"""Config loading: defaults, --options, and one clear error per bad input."""
from __future__ import annotations

import json
import re

import pytest
import yaml
from omegaconf import OmegaConf

import lavis_ds  # noqa: F401
from lavis_ds.config import ConfigError, load_config
from run_utils import REPO, run_train, write_yaml

# Run YAMLs; lmms-eval task YAMLs (projects/*/lmms_eval/, docs/evaluation.md) are lmms-eval's, not run configs
PROJECT_YAMLS = sorted(p for p in (REPO / "projects").rglob("*.yaml") if "lmms_eval" not in p.parts)
# The one shipped YAML that says its DeepSpeed settings in DeepSpeed's words, to show a DeepSpeed JSON as it is
DEEPSPEED_SPELLED = REPO / "projects/minigpt4qwen/zero2_offload.yaml"


@pytest.fixture
def instruction_data(tmp_path):
    """A real one-record instruction dataset and a valid config using it."""
    (tmp_path / "images").mkdir()
    from PIL import Image
    Image.new("RGB", (32, 32), "red").save(tmp_path / "images" / "a.png")
    ann = tmp_path / "train.json"
    ann.write_text(json.dumps([{"image": "a.png", "instruction": "<Img><ImageHere></Img> What?", "output": "red"}]))
    return tmp_path, ann


def _cfg(tmp_path, ann, tokenizer_dir, **edits):
    cfg = {
        "model": {"arch": "blip2_qwen", "model_type": "tiny", "tokenizer": str(tokenizer_dir)},
        "datasets": {"minigpt4qwen_instruction": {"build_info": {
            "annotations": {"train": {"storage": str(ann)}}, "images": {"storage": str(tmp_path / "images")}},
            # The tiny model's ViT takes 64 px images.
            "vis_processor": {"train": {"image_size": 64}, "eval": {"image_size": 64}}}},
        "run": {"output_dir": str(tmp_path / "out"),
                "batch_size_train": 1, "zero_stage": 2},
    }
    for dotted, value in edits.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return write_yaml(tmp_path / "run.yaml", cfg)


def _problems(path, options=(), world_size=1):
    with pytest.raises(ConfigError) as info:
        load_config(path, options, world_size=world_size)
    return info.value.problems


def test_defaults_merge_under_the_user_and_options_override(instruction_data, tiny_tokenizer_dir):
    tmp_path, ann = instruction_data
    cfg = load_config(_cfg(tmp_path, ann, tiny_tokenizer_dir), ["run.init_lr=0.5", "model.num_query_token=4"])
    assert cfg.run.init_lr == 0.5 and cfg.model.num_query_token == 4
    assert cfg.model.qformer.hidden_size == 64  # from the tiny preset
    assert cfg.datasets.minigpt4qwen_instruction.vis_processor.train.name == "blip2_image_train"  # builder default
    assert cfg.run.output_dir == str(tmp_path / "out")  # exactly as given: no timestamp


@pytest.mark.parametrize("option, message", [
    ("model.frezee_vit=true", r"model\.frezee_vit: unknown key; did you mean 'freeze_vit'\?"),
    ("model.arch=blip2_qwn", r"model\.arch: Unknown model 'blip2_qwn'\. Did you mean 'blip2_qwen'\?"),
    ("run.deepspeed_config.zero_optimization.stage=5",
     r"run\.deepspeed_config\.zero_optimization\.stage: 5 is not a ZeRO stage; valid: 0, 1, 2, 3"),
    ("run.zero_stage=5", r"run\.zero_stage: expected 0 \| 1 \| 2 \| 3 \| null, got 5"),
    ("run.offload_params=cpu", r"run\.offload_params: expected bool \| null, got 'cpu'"),
    ("run.accum_grad_iters=1 run.global_batch_size=64",
     r"run\.global_batch_size=64 but batch_size_train=1 x accum_grad_iters=1 x world size 1 = 1"),
    ("run.deepspeed_config.train_micro_batch_size_per_gpu=2",
     r"run\.batch_size_train=1 and run\.deepspeed_config\.train_micro_batch_size_per_gpu=2 disagree"),
    ("run.init_lr=fast", r"run\.init_lr: expected float, got 'fast'"),
    ("run.lr_sched=cosine", r"run\.lr_sched: Unknown lr scheduler 'cosine'"),
    ("model.vit_precision=fp8", r"model\.vit_precision: expected 'fp32' \| 'fp16' \| 'bf16', got 'fp8'"),
    ("run.valid_splits=[val]", r"run\.valid_splits: split 'val' is not in any dataset; available: train"),
    ("datasets.minigpt4qwen_instruction.vis_processor.eval.image_size=224",
     r"datasets\.minigpt4qwen_instruction\.vis_processor\.eval\.image_size: 224 but "
                            r"model\.image_size is 64; the vision tower takes images of model\.image_size only"),
])
def test_each_bad_value_gives_one_clear_error(instruction_data, tiny_tokenizer_dir, option, message):
    tmp_path, ann = instruction_data
    problems = _problems(_cfg(tmp_path, ann, tiny_tokenizer_dir), option.split())
    assert len(problems) == 1, problems
    assert re.search(message, problems[0]), problems[0]


def test_missing_annotation_file_names_key_and_file(instruction_data, tiny_tokenizer_dir):
    tmp_path, ann = instruction_data
    missing = tmp_path / "nope.json"
    problems = _problems(_cfg(tmp_path, missing, tiny_tokenizer_dir))
    assert len(problems) == 1
    assert "datasets.minigpt4qwen_instruction.build_info.annotations.train.storage" in problems[0]
    assert str(missing) in problems[0]


def test_every_problem_is_reported_at_once(instruction_data, tiny_tokenizer_dir):
    tmp_path, ann = instruction_data
    problems = _problems(_cfg(tmp_path, ann, tiny_tokenizer_dir),
                         ["model.frezee_vit=true", "run.max_epoc=3", "run.deepspeed_config.zero_optimization.stage=5"])
    assert len(problems) == 3
    assert any("run.max_epoc" in p and "max_epoch" in p for p in problems)


def test_batch_sizes_are_checked_against_the_world_size(instruction_data, tiny_tokenizer_dir):
    tmp_path, ann = instruction_data
    path = _cfg(tmp_path, ann, tiny_tokenizer_dir, **{"run.global_batch_size": 2})
    assert load_config(path, world_size=2).run.deepspeed_config.train_batch_size == 2
    # Without accum_grad_iters the global batch sets it (as in DeepSpeed): 2 = 1 x 2 x 1 on 1 process.
    one = load_config(path, world_size=1).run
    assert (one.accum_grad_iters, one.deepspeed_config.gradient_accumulation_steps) == (2, 2)
    assert _problems(path, world_size=4) == [
        "run.global_batch_size: a global batch of 2 cannot be split into micro-batches of 1 on "
        "4 processes (2 is not a multiple of 1 x 4); process counts that keep it: 1, 2"]


def test_train_py_prints_the_problems_without_a_traceback(instruction_data, tiny_tokenizer_dir):
    tmp_path, ann = instruction_data
    proc = run_train(_cfg(tmp_path, ann, tiny_tokenizer_dir), nproc=0,
                     options=("model.arch=blip2_qwn",), check=False, launcher="launch")
    assert proc.returncode == 2
    assert "model.arch: Unknown model 'blip2_qwn'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_top_level_key_and_missing_file(tmp_path):
    assert "config file not found" in _problems(tmp_path / "absent.yaml")[0]
    path = write_yaml(tmp_path / "x.yaml", {"modle": {}, "model": {"arch": "blip2_qwen"}, "datasets": {}, "run": {}})
    problems = _problems(path)
    assert any("<top level>.modle: unknown key; did you mean 'model'?" in p for p in problems)


@pytest.mark.parametrize("path", PROJECT_YAMLS, ids=[str(p.relative_to(REPO)) for p in PROJECT_YAMLS])
def test_every_project_yaml_loads_and_validates(path):
    # Structure only: the full-size YAMLs name weight folders that exist on the user's machine, not here.
    cfg = load_config(path, world_size=2 if "demo" in path.parts else 4, check_files=False)
    assert cfg.model.arch and cfg.run.output_dir
    # One spelling per setting: the ZeRO stage is run.zero_stage, and it is what DeepSpeed is handed.
    run = yaml.safe_load(path.read_text())["run"]
    assert ("deepspeed_config" in run) == (path == DEEPSPEED_SPELLED), f"{path}: spells its ZeRO settings otherwise"
    stage = run["deepspeed_config"]["zero_optimization"]["stage"] if path == DEEPSPEED_SPELLED else run["zero_stage"]
    assert cfg.run.deepspeed_config.zero_optimization.stage == stage


def test_replacing_a_default_processor_drops_its_default_arguments(instruction_data, tiny_tokenizer_dir):
    tmp_path, ann = instruction_data
    path = _cfg(tmp_path, ann, tiny_tokenizer_dir, **{
        "datasets.minigpt4qwen_instruction.vis_processor": {"train": {"name": "blip2_image_eval", "image_size": 64}, "eval": {"image_size": 64}}})
    cfg = load_config(path)
    assert dict(cfg.datasets.minigpt4qwen_instruction.vis_processor.train) == {"name": "blip2_image_eval", "image_size": 64}
    assert cfg.datasets.minigpt4qwen_instruction.vis_processor.eval.name == "blip2_image_eval"  # default kept
    # The builder merges its defaults again when it is built: the replaced arguments stay dropped.
    from lavis_ds.datasets import DemoShapesBuilder
    section = {"build_info": {"storage": str(tmp_path / "unused")},
               "vis_processor": {"train": {"name": "blip2_image_eval", "image_size": 32}}}
    assert DemoShapesBuilder(section).cfg["vis_processor"]["train"] == {"name": "blip2_image_eval", "image_size": 32}


def test_a_deepspeed_yaml_switched_to_fsdp_keeps_its_batch_precision_and_adam_settings(instruction_data,
                                                                                     tiny_tokenizer_dir, caplog):
    """Switching run.runner and nothing else: the DeepSpeed section's words for the neutral run keys become
    those keys (config.yaml records them), and what runner_fsdp does not read of it is named."""
    tmp_path, ann = instruction_data
    path = _cfg(tmp_path, ann, tiny_tokenizer_dir, **{
        "run.runner": "runner_fsdp", "run.zero_stage": None, "run.deepspeed_config.zero_optimization": {"stage": 2},
        "run.deepspeed_config.gradient_accumulation_steps": 4, "run.deepspeed_config.gradient_clipping": 0.5,
        "run.deepspeed_config.bf16": {"enabled": True},
        "run.deepspeed_config.optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.95], "eps": 1e-6}}})
    with caplog.at_level("WARNING"):
        cfg = load_config(path, world_size=2)
    run = cfg.run
    assert (run.batch_size_train, run.accum_grad_iters, run.global_batch_size) == (1, 4, 8)
    assert (run.grad_norm_clip, run.precision, list(run.adam_betas), run.adam_eps) == (0.5, "bf16", [0.8, 0.95], 1e-6)
    assert "not used: zero_optimization" in caplog.text  # the only key that says nothing about the run keys

    same_under_deepspeed = load_config(path, ["run.runner=runner_deepspeed"], world_size=2).run
    assert {key: same_under_deepspeed[key] for key in ("batch_size_train", "accum_grad_iters", "global_batch_size",
                                                       "grad_norm_clip", "precision", "adam_eps")} == \
        {key: run[key] for key in ("batch_size_train", "accum_grad_iters", "global_batch_size", "grad_norm_clip",
                                   "precision", "adam_eps")}
    ds = same_under_deepspeed.deepspeed_config
    assert list(ds.optimizer.params.betas) == [0.8, 0.95] and ds.bf16.enabled is True


# (run keys, the same in DeepSpeed's words): the ZeRO stage and offload
ZERO_SPELLINGS = {
    "stage 3, both offloaded": ({"run.zero_stage": 3, "run.offload_optimizer": True, "run.offload_params": True},
                                {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    "stage 1, no offload": ({"run.zero_stage": 1, "run.offload_optimizer": False},
                            {"stage": 1, "offload_optimizer": {"device": "none"}}),
    # a run key and what only the DeepSpeed section can say about the same offload
    "with pin_memory": ({"run.offload_optimizer": True,
                         "run.deepspeed_config.zero_optimization": {"offload_optimizer": {"pin_memory": True}}},
                        {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
}


@pytest.mark.parametrize("native, deepspeed", ZERO_SPELLINGS.values(), ids=ZERO_SPELLINGS.keys())
def test_the_zero_keys_and_their_deepspeed_spelling_hand_deepspeed_one_config(instruction_data, tiny_tokenizer_dir,
                                                                              native, deepspeed):
    tmp_path, ann = instruction_data

    def handed(**edits):
        run = load_config(_cfg(tmp_path, ann, tiny_tokenizer_dir, **edits), world_size=2).run
        return OmegaConf.to_container(run.deepspeed_config)

    as_run_keys = handed(**native)
    assert as_run_keys == handed(**{"run.zero_stage": None, "run.deepspeed_config.zero_optimization": deepspeed})
    assert as_run_keys == handed(**{**native, "run.deepspeed_config.zero_optimization": deepspeed})  # both, agreeing
    assert as_run_keys["zero_optimization"] == deepspeed  # nothing added, nothing lost
    assert as_run_keys.get("zero_force_ds_cpu_optimizer", False) == (deepspeed["offload_optimizer"]["device"] == "cpu")


def test_the_zero_keys_under_runner_fsdp_are_named_as_unused(instruction_data, tiny_tokenizer_dir, caplog):
    tmp_path, ann = instruction_data
    path = _cfg(tmp_path, ann, tiny_tokenizer_dir, **{"run.runner": "runner_fsdp", "run.offload_optimizer": True})
    with caplog.at_level("WARNING"):
        run = load_config(path).run
    assert "run.zero_stage=2, run.offload_optimizer=True: read by runner_deepspeed only; runner_fsdp does not use " \
           "them" in caplog.text
    assert "deepspeed_config" not in run  # nothing of DeepSpeed's is made for an FSDP run


@pytest.mark.parametrize("edits, message", [
    ({"run.adam_betas": [0.9, 0.999], "run.deepspeed_config.optimizer": {"params": {"betas": [0.8, 0.95]}}},
     r"run\.adam_betas=\[0\.9, 0\.999\] and run\.deepspeed_config\.optimizer\.params\.betas=\[0\.8, 0\.95\] disagree"),
    ({"run.deepspeed_config.bf16": {"enabled": True}, "run.deepspeed_config.fp16": {"enabled": True}},
     r"run\.deepspeed_config\.bf16\.enabled=True and run\.deepspeed_config\.fp16\.enabled=True disagree"),
    ({"run.precision": "bf16", "run.deepspeed_config.bf16": {"enabled": False}},
     r"run\.precision='bf16' and run\.deepspeed_config\.bf16\.enabled=False disagree"),
    ({"run.adam_betas": [0.9]}, r"run\.adam_betas: expected two numbers in \[0, 1\)"),
    ({"run.deepspeed_config.optimizer": {"params": {"betas": 0.9}}},
     r"run\.deepspeed_config\.optimizer\.params\.betas: expected two numbers in \[0, 1\) \(beta1, beta2\), got 0\.9"),
    ({"run.deepspeed_config.optimizer": {"params": {"eps": "tiny"}}},
     r"run\.deepspeed_config\.optimizer\.params\.eps: expected a number > 0, got 'tiny'"),
    ({"run.deepspeed_config.gradient_accumulation_steps": "four"},
     r"run\.deepspeed_config\.gradient_accumulation_steps: expected a positive integer, got 'four'"),
    ({"run.zero_stage": 3, "run.deepspeed_config.zero_optimization": {"stage": 2}},
     r"^run\.zero_stage=3 and run\.deepspeed_config\.zero_optimization\.stage=2 disagree; they are the same setting, "
     r"give one$"),
    ({"run.offload_optimizer": False, "run.deepspeed_config.zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     r"^run\.offload_optimizer=False and run\.deepspeed_config\.zero_optimization\.offload_optimizer\.device='cpu' "
     r"disagree"),
    ({"run.zero_stage": 3, "run.offload_params": True,
      "run.deepspeed_config.zero_optimization": {"offload_param": {"device": "none"}}},
     r"^run\.offload_params=True and run\.deepspeed_config\.zero_optimization\.offload_param\.device='none' disagree"),
])
@pytest.mark.parametrize("engine", ["runner_deepspeed", "runner_fsdp"])
def test_a_neutral_key_and_its_twin_that_disagree_are_named_under_every_engine(instruction_data, tiny_tokenizer_dir,
                                                                             edits, message, engine):
    tmp_path, ann = instruction_data
    problems = _problems(_cfg(tmp_path, ann, tiny_tokenizer_dir, **{"run.runner": engine, **edits}))
    assert any(re.search(message, p) for p in problems), problems


def test_a_token_budget_is_resolved_into_the_config(instruction_data, tiny_tokenizer_dir):
    """run.packing counts batch_size_train in rows of max_seq_len tokens; config.yaml says what a step holds, and
    run.global_batch_tokens, like global_batch_size, fixes the accumulation."""
    tmp_path, ann = instruction_data
    path = _cfg(tmp_path, ann, tiny_tokenizer_dir, **{"run.packing": True, "run.max_seq_len": 512})
    run = load_config(path, world_size=2).run
    assert (run.batch_unit, run.global_batch_size, run.global_batch_tokens) == ("tokens", 2, 1024)
    run = load_config(path, ["run.global_batch_tokens=4096"], world_size=2).run
    assert (run.accum_grad_iters, run.global_batch_size, run.global_batch_tokens) == (4, 8, 4096)
    assert run.deepspeed_config.gradient_accumulation_steps == 4
    run = load_config(path, ["run.batch_unit=samples"], world_size=2).run  # packing of N samples per micro-batch
    assert (run.batch_unit, run.global_batch_tokens) == ("samples", None)
    assert load_config(_cfg(tmp_path, ann, tiny_tokenizer_dir)).run.batch_unit is None  # samples, as always


@pytest.mark.parametrize("options, message", [
    (["run.length_grouped=true"], r"run\.length_grouped: sorts micro-batches of a fixed number of samples, but this "
                                  r"run fills them by tokens"),
    (["run.global_batch_tokens=1000"], r"run\.global_batch_tokens=1000 is not a multiple of run\.max_seq_len=512"),
    (["run.global_batch_tokens=1024", "run.deepspeed_config.train_batch_size=4"],
     r"run\.global_batch_tokens=1024 is 2 rows of run\.max_seq_len=512, but "
     r"run\.deepspeed_config\.train_batch_size=4; give one of the two"),
    (["run.packing=false", "run.batch_unit=samples", "run.global_batch_tokens=1024"],
     r"run\.global_batch_tokens: only with run\.batch_unit: tokens"),
    (["run.packing=false", "run.batch_unit=tokens", "run.max_seq_len=null"],
     r"run\.batch_unit: tokens: set run\.max_seq_len"),
    (["run.max_seq_len=100"], r"run\.max_seq_len=100 is shorter than model\.max_txt_len=256"),
    # Qwen3-Next's linear attention would carry one packed sample's state into the next (tests/test_qwen3_5_llm.py)
    (["model.llm_config.model_type=qwen3_next"], r"run\.packing: the LLM Qwen3NextForCausalLM \(model_type "
                                                 r"qwen3_next\) has recurrent layers \(linear_attention\)"),
])
def test_a_token_budget_that_cannot_work_is_one_clear_error(instruction_data, tiny_tokenizer_dir, options, message):
    tmp_path, ann = instruction_data
    path = _cfg(tmp_path, ann, tiny_tokenizer_dir, **{"run.packing": True, "run.max_seq_len": 512})
    problems = _problems(path, options)
    assert len(problems) == 1, problems
    assert re.search(message, problems[0]), problems[0]


def test_checking_a_config_writes_nothing_and_building_generates_the_demo(tmp_path):
    """load_config reads: the demo's data (and the tokenizer inside it) is generated by the build, not the check."""
    from lavis_ds.build import prepare_datasets

    storage = tmp_path / "demo"
    options = [f"datasets.demo_shapes.build_info.storage={storage}", "datasets.demo_shapes.build_info.num_train=16",
               "datasets.demo_shapes.build_info.num_val=8", "datasets.demo_shapes.build_info.num_test=8"]
    cfg = load_config(REPO / "projects/demo/tiny_zero2.yaml", options)
    assert cfg.model.tokenizer == f"{storage}/tokenizer" and not storage.exists()
    prepare_datasets(cfg.datasets)
    assert (storage / "DONE").is_file() and (storage / "tokenizer").is_dir()
    assert load_config(REPO / "projects/demo/tiny_zero2.yaml", options).model.tokenizer == f"{storage}/tokenizer"


def test_demo_data_generated_with_other_sizes_is_a_config_problem(tmp_path):
    """The check reads the demo folder's DONE file: other parameters are named before anything is built."""
    from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

    storage = ensure_demo_shapes(tmp_path / "demo", DemoShapesSpec(num_train=8, num_val=2, num_test=2))
    options = [f"datasets.demo_shapes.build_info.storage={storage}", "datasets.demo_shapes.build_info.num_train=16",
               "datasets.demo_shapes.build_info.num_val=2", "datasets.demo_shapes.build_info.num_test=2"]
    with pytest.raises(ConfigError, match=r"datasets\.demo_shapes\.build_info\.storage: .*/demo was generated with other parameters "
                                          r"\(num_train: 8 on disk vs 16 requested\)"):
        load_config(REPO / "projects/demo/tiny_zero2.yaml", options)
