"""One bad key at a time, at every depth of a valid config: each gives one message naming the key path
and what would be valid. In process (load_config), on a real one-record dataset and the tiny model."""
from __future__ import annotations

import json
import logging
import re

import pytest

import lavis_ds  # noqa: F401
from lavis_ds.config import ConfigError, load_config
from run_utils import write_yaml

DS = "run.deepspeed_config"
SECTION = "datasets.minigpt4qwen_instruction"


@pytest.fixture
def valid_config(tmp_path, tiny_tokenizer_dir):
    """A config that loads (files checked): one image, one record, the tiny model."""
    from PIL import Image

    (tmp_path / "images").mkdir()
    Image.new("RGB", (32, 32), "red").save(tmp_path / "images" / "a.png")
    ann = tmp_path / "train.json"
    ann.write_text(json.dumps([{"image": "a.png", "instruction": "<Img><ImageHere></Img> What?", "output": "red"}]))
    cfg = {
        "model": {"arch": "blip2_qwen", "model_type": "tiny", "tokenizer": str(tiny_tokenizer_dir)},
        "datasets": {"minigpt4qwen_instruction": {
            "build_info": {"annotations": {"train": {"storage": str(ann)}}, "images": {"storage": str(tmp_path / "images")}},
            "vis_processor": {"train": {"image_size": 64}, "eval": {"image_size": 64}}}},
        "run": {"output_dir": str(tmp_path / "out"),
                "batch_size_train": 1, "zero_stage": 2},
    }
    path = write_yaml(tmp_path / "run.yaml", cfg)
    load_config(path)  # the baseline is valid: every failure below comes from its one mutation
    return path


# (--options, regex the single problem must match: key path and what is valid)
MUTATIONS = {
    # values out of range
    "negative max_epoch": ("run.max_epoch=-1", r"^run\.max_epoch: -1 is out of range; valid: >= 1$"),
    "micro-batch 0": (f"{DS}.train_micro_batch_size_per_gpu=0",
                      rf"^{DS}\.train_micro_batch_size_per_gpu: expected a positive integer, got 0$"),
    "batch_size_train 0": ("run.batch_size_train=0",
                           r"^run\.batch_size_train: 0 is out of range; valid: >= 1$"),
    "accumulation 0": (f"{DS}.gradient_accumulation_steps=0",
                       rf"^{DS}\.gradient_accumulation_steps: expected a positive integer, got 0$"),
    "negative lr": ("run.init_lr=-0.001", r"^run\.init_lr: -0\.001 is out of range; valid: >= 0$"),
    "negative min_lr": ("run.min_lr=-1e-6", r"^run\.min_lr: -1e-06 is out of range; valid: >= 0$"),
    "warmup_ratio > 1": ("run.warmup_ratio=1.5", r"^run\.warmup_ratio: 1\.5 is out of range; valid: >= 0 and <= 1$"),
    "negative warmup_steps": ("run.warmup_steps=-5", r"^run\.warmup_steps: -5 is out of range; valid: >= 0$"),
    "keep_last < 0": ("run.keep_last=-1", r"^run\.keep_last: -1 is out of range; valid: >= 0$"),
    "num_workers < 0": ("run.num_workers=-2", r"^run\.num_workers: -2 is out of range; valid: >= 0$"),
    "log_freq 0": ("run.log_freq=0", r"^run\.log_freq: 0 is out of range; valid: >= 1$"),
    "batch_size_eval 0": ("run.batch_size_eval=0", r"^run\.batch_size_eval: 0 is out of range; valid: >= 1$"),
    "negative weight_decay": ("run.weight_decay=-0.1", r"^run\.weight_decay: -0\.1 is out of range; valid: >= 0$"),
    "negative seed": ("run.seed=-1", r"^run\.seed: -1 is out of range; valid: >= 0$"),
    "negative save_freq_steps": ("run.save_freq_steps=-10", r"^run\.save_freq_steps: -10 is out of range; valid: >= 0$"),
    "lr_decay_rate 0": ("run.lr_decay_rate=0", r"^run\.lr_decay_rate: 0 is out of range; valid: > 0$"),
    "negative clipping": (f"{DS}.gradient_clipping=-1",
                          rf"^{DS}\.gradient_clipping: expected a number >= 0 \(0: no clipping\), got -1$"),
    "ZeRO stage 4": (f"{DS}.zero_optimization.stage=4",
                     rf"^{DS}\.zero_optimization\.stage: 4 is not a ZeRO stage; valid: 0, 1, 2, 3$"),
    "ZeRO stage true": ("run.zero_stage=true", r"^run\.zero_stage: expected 0 \| 1 \| 2 \| 3 \| null, got True$"),
    # typos at every depth
    "top level": ("modle.arch=x", r"^<top level>\.modle: unknown key; did you mean 'model'\?$"),
    "model": ("model.freeze_qformr=true", r"^model\.freeze_qformr: unknown key; did you mean 'freeze_qformer'\?$"),
    "model.qformer": ("model.qformer.hidden_sise=64",
                      r"^model\.qformer\.hidden_sise: unknown key; did you mean 'hidden_size'\?$"),
    "model.vit": ("model.vit.dept=2", r"^model\.vit\.dept: unknown key; did you mean 'depth'\?$"),
    "datasets.<x>": (f"{SECTION}.sample_ratoi=2",
                     rf"^{SECTION}\.sample_ratoi: unknown key; did you mean 'sample_ratio'\?$"),
    "build_info": (f"{SECTION}.build_info.imagse.storage=x",
                   rf"^{SECTION}\.build_info\.imagse: unknown key; valid keys: annotations, images, videos, max_frames$"),
    "vis_processor stage": (f"{SECTION}.vis_processor.trian.name=blip2_image_train",
                            rf"^{SECTION}\.vis_processor\.trian: unknown key; did you mean 'train'\?$"),
    "vis_processor key": (f"{SECTION}.vis_processor.train.image_sise=64",
                          rf"^{SECTION}\.vis_processor\.train\.image_sise: unknown key; did you mean 'image_size'\?$"),
    "run": ("run.warmup_step=3", r"^run\.warmup_step: unknown key; did you mean 'warmup_steps'\?$"),
    "deepspeed_config": (f"{DS}.gradient_clippng=1.0",
                         rf"^{DS}\.gradient_clippng: unknown key; did you mean 'gradient_clipping'\?$"),
    "zero_optimization": (f"{DS}.zero_optimization.stag=2",
                          rf"^{DS}\.zero_optimization\.stag: unknown key; did you mean 'stage'\?$"),
    "offload_optimizer": (f"{DS}.zero_optimization.offload_optimizer.devic=cpu",
                          rf"^{DS}\.zero_optimization\.offload_optimizer\.devic: unknown key; did you mean 'device'\?$"),
    "bf16": (f"{DS}.bf16.enabeld=true", rf"^{DS}\.bf16\.enabeld: unknown key; did you mean 'enabled'\?$"),
    "activation_checkpointing": (f"{DS}.activation_checkpointing.partition_activation=true",
                                 rf"^{DS}\.activation_checkpointing\.partition_activation: unknown key; "
                                 rf"did you mean 'partition_activations'\?$"),
    "optimizer": (f"{DS}.optimizer.typ=AdamW", rf"^{DS}\.optimizer\.typ: unknown key; did you mean 'type'\?$"),
    "zero value type": (f"{DS}.zero_optimization.overlap_comm=maybe",
                        rf"^{DS}\.zero_optimization\.overlap_comm: Input should be a valid boolean.*\(got 'maybe'\)$"),
    # keys that contradict each other (what the model's constructor would refuse after loading weights)
    "vit key set at top level": ("model.vit.img_size=64", r"^model\.vit\.img_size: set it with model\.image_size"),
    "LoRA on a trainable LLM": ("model.get_lora=true model.freeze_llm=false",
                                r"^model\.get_lora: true trains only the LoRA adapters, so it needs model\.freeze_llm: true$"),
    "record_system_prompt": ("model.record_system_prompt=always",
                             r"^model\.record_system_prompt: expected 'use' \| 'ignore' \| 'fold', got 'always'$"),
    "no tokenizer": ("model.tokenizer=null", r"^model\.tokenizer: required when model\.llm_model is null"),
    # unknown names
    "arch": ("model.arch=blip2_qwn",
             r"^model\.arch: Unknown model 'blip2_qwn'\. Did you mean 'blip2_qwen'\? Known models: "),
    "model_type": ("model.model_type=tinyy",
                   r"^model\.model_type: Unknown model_type 'tinyy' for Blip2Qwen\. Did you mean 'tiny'\?"),
    "processor": (f"{SECTION}.vis_processor.train.name=blip2_image_trian",
                  rf"^{SECTION}\.vis_processor\.train\.name: Unknown processor 'blip2_image_trian'\. Did you mean "
                  rf"'blip2_image_train'\?"),
    "runner": ("run.runner=runner_deepspeeed",
               r"^run\.runner: Unknown engine 'runner_deepspeeed'\. Did you mean 'runner_deepspeed'\?"),
    "lr_sched": ("run.lr_sched=linear_warmup_cosine",
                 r"^run\.lr_sched: Unknown lr scheduler 'linear_warmup_cosine'\. Did you mean"),
    "hook": ("run.hooks=[tensorboard,mlfow]",
             r"^run\.hooks\[1\]: Unknown hook 'mlfow'\. Did you mean 'mlflow'\? Known hooks: best_checkpoint, "),
    "hook option": ("run.hooks=[{}] run.hooks.0.name=mlflow run.hooks.0.tracking_ur=file:/x",
                    r"^run\.hooks\[0\]\.tracking_ur: unknown key; did you mean 'tracking_uri'\?$"),
    "built-in hook": ("run.hooks=[checkpointer]", r"^run\.hooks\[0\]: 'checkpointer' is a built-in hook and always runs"),
    # LAVIS keys with a replacement
    "iters_per_epoch": ("run.iters_per_epoch=100", r"^run\.iters_per_epoch: not supported; .*use run\.max_epoch"),
    "lr_layer_decay": ("run.lr_layer_decay=0.9", r"^run\.lr_layer_decay: not supported; use run\.lr_scales"),
    "load_finetuned": ("model.load_finetuned=true", r"^model\.load_finetuned: True: .*use run\.resume.*model\.pretrained"),
    "fsdp": ("run.fsdp=true", r"^run\.fsdp: True: .*choose the engine with run\.runner: runner_fsdp"),
    "qformer_text_input": ("model.qformer_text_input=true", r"^model\.qformer_text_input: True: .*set it false"),
    "autocast_dtype": ("model.autocast_dtype=float8",
                       r"^model\.autocast_dtype: 'float8' is not a dtype; valid: bfloat16, "),
    "accum conflict": (f"run.accum_grad_iters=4 {DS}.gradient_accumulation_steps=2",
                       rf"^run\.accum_grad_iters=4 and {DS}\.gradient_accumulation_steps=2 disagree"),
    "amp conflict": (f"run.amp=false {DS}.bf16.enabled=true",
                     rf"^run\.amp=False means fp32 but {DS}\.bf16\.enabled is True; they disagree"),
    # --options and splits
    "option without a value": ("run.max_epoch", r"^--options run\.max_epoch: no '=value'; write run\.max_epoch=<value>"),
    "no train split": ("run.train_splits=[]", r"^run\.train_splits: empty, so nothing trains; name the split\(s\) to "
                                              r"train on \(available: train\), or set run\.evaluate: true"),
    "Qwen-1 model_type": ("model.model_type=qwen7b_chat",
                          r"^model\.model_type: model_type 'qwen7b_chat' is not supported: .*Qwen-1.*'qwen2\.5_7b_instruct'"),
}


@pytest.mark.parametrize("options, message", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_one_mutation_one_clear_problem(valid_config, options, message):
    with pytest.raises(ConfigError) as info:
        load_config(valid_config, options.split())
    problems = info.value.problems
    assert len(problems) == 1, problems
    assert re.search(message, problems[0]), problems[0]


def test_lavis_keys_that_map_are_accepted_and_said_once(valid_config, caplog):
    with caplog.at_level(logging.WARNING, logger="lavis_ds"):
        cfg = load_config(valid_config, ["run.accum_grad_iters=4", "run.grad_norm_clip=0.5", "run.amp=true",
                                         "run.task=image_text_pretrain", "model.enable_autocast=false"])
    ds = cfg.run.deepspeed_config
    assert (ds.gradient_accumulation_steps, ds.gradient_clipping, ds.fp16.enabled) == (4, 0.5, True)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("ignored: model.enable_autocast" in line and "run.task" not in line for line in lines) == 1, lines
    assert cfg.run.task == "image_text_pretrain"  # not ignored: LAVIS's task name, an alias of the sft objective
    assert sum("run.amp=True -> run.precision = fp16" in line for line in lines) == 1, lines


# ---------------------------------------------------------------------------- settings that do nothing


@pytest.mark.parametrize("offload, where", [(f"{DS}.zero_optimization.offload_param.device=cpu",
                                             f"{DS}.zero_optimization.offload_param"),
                                            ("run.offload_params=true", "run.offload_params")])
def test_offload_param_below_zero3_is_a_warning(valid_config, caplog, offload, where):
    """The warning names the spelling the run used."""
    with caplog.at_level(logging.WARNING, logger="lavis_ds"):
        load_config(valid_config, [offload])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith(f"{where}: has no effect at ZeRO stage 2") and "stage 3" in w for w in warnings), warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lavis_ds"):
        load_config(valid_config, [offload, "run.zero_stage=3"])
    assert not any("offload_param" in r.getMessage() for r in caplog.records)


def test_lr_scales_prefix_matching_no_parameter_is_an_error(tiny_model_config, caplog):
    from lavis_ds.models import Blip2Qwen
    from lavis_ds.optim import build_param_groups

    model = Blip2Qwen.from_config({**tiny_model_config, "freeze_vit": True})
    with pytest.raises(ConfigError, match=r"^1 problem\(s\) in run\.lr_scales:\n  - run\.lr_scales\.llm_prj: matches no "
                                          r"parameter of the model; did you mean 'llm_proj'\?$"):
        build_param_groups(model, 0.05, {"llm_prj": 10.0, "llm_proj": 5.0})
    with pytest.raises(ConfigError, match=r"run\.lr_scales\.zzz: matches no parameter of the model; trainable "
                                          r"parameter names start with connector, llm_model"):
        build_param_groups(model, 0.05, {"zzz": 2.0})
    # Only frozen parameters (the ViT, frozen here): no effect, said once, not an error.
    with caplog.at_level(logging.WARNING, logger="lavis_ds"):
        groups = build_param_groups(model, 0.05, {"visual_encoder": 0.1, "llm_proj": 5.0})
    assert {g["lr_scale"] for g in groups} == {1.0, 5.0}
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["run.lr_scales.visual_encoder: the prefix names only frozen parameters, so this factor has "
                        "no effect"], warnings
