"""Export: a checkpoint of any ZeRO stage -> safetensors + config, loaded and generating without DeepSpeed.

Each configuration trains once (2 processes, 4 optimizer steps, test-split generation
and validation loss at the end) and is shared by the tests that need it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import demo_storage_fixture
from lavis_ds.datasets.demo_shapes import DemoShapesSpec
from lavis_ds.apps.export import ExportError, export_checkpoint, find_checkpoint, load_exported
from lavis_ds.runners.checkpoint import COMPLETE_MARKER
from run_utils import REPO, env, metrics, run_together, run_train, tiny_config, write_yaml

DEMO = DemoShapesSpec(num_train=32, num_val=16, num_test=8)
NPROC, BATCH_SIZE_EVAL = 2, 8
# min_new_tokens: an undertrained model's first token is often <|im_end|>; texts of some tokens
# say more about the weights (the exact validation loss says the most).
NEW_TOKENS = 6
LORA = {"freeze_vit": True, "freeze_llm": True, "get_lora": True, "lora_r": 4}
RUNS = {
    "zero0_fp32": {"stage": 0},
    "zero0_bf16": {"stage": 0, "dtype": "bf16"},  # fp32 masters in FP16_Optimizer's flat groups
    "zero1_lora_frozen_vit": {"stage": 1, "model": LORA},  # frozen parts come back from the seed
    "zero2_fp32": {"stage": 2},
    "zero2_bf16": {"stage": 2, "dtype": "bf16"},  # fp32 masters in bf16_zero_pp_rank_* files
    "zero3_fp32": {"stage": 3},
}


demo_storage = demo_storage_fixture(num_train=DEMO.num_train, num_val=DEMO.num_val, num_test=DEMO.num_test)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_storage):
    """``trained(name)`` -> the output_dir of run ``name`` (trained on first use)."""
    root = tmp_path_factory.mktemp("runs")
    done = {}

    def get(name: str) -> Path:
        if name not in done:
            spec = dict(RUNS[name])
            out = root / name
            cfg = tiny_config(out, demo_storage, stage=spec["stage"], dtype=spec.get("dtype", "fp32"),
                              batch_size_eval=BATCH_SIZE_EVAL, valid_splits=["val"], test_splits=["test"],
                              num_log_samples=DEMO.num_test,
                              generate={"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS})
            cfg["model"].update(spec.get("model", {}))
            run_train(write_yaml(root / f"{name}.yaml", cfg), nproc=NPROC)
            done[name] = out
        return done[name]

    return get


@pytest.fixture(scope="module")
def exported(tmp_path_factory, trained):
    """``exported(name)`` -> an export folder of run ``name``'s newest checkpoint (given as the run dir)."""
    root = tmp_path_factory.mktemp("exports")
    done = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = export_checkpoint(trained(name), root / name)
        return done[name]

    return get


def _trained_results(output_dir: Path) -> tuple[list[str], float]:
    """What the run logged at its end: generated test texts (in sample order) and validation loss."""
    lines = metrics(output_dir)
    test = [m for m in lines if m.get("split") == "test"][-1]
    val = [m for m in lines if m.get("split") == "val"][-1]
    assert test["num_samples"] == len(test["samples"]) == DEMO.num_test
    return [s["generated"] for s in sorted(test["samples"], key=lambda s: s["index"])], val["loss"]


# Runs in a fresh interpreter that imports what loading and generating need, then forks one process per export
# folder, which reports whether DeepSpeed got imported (by those imports or by its own work). It replays the
# trainer's evaluation batches (each rank's shard of the split, EvalBatchSampler) so that the numbers can be
# compared exactly: the CLI generates the test split, the loaded model computes the validation loss.
WITHOUT_DEEPSPEED = r"""
import contextlib, io, json, os, sys, traceback
from pathlib import Path
import torch
from lavis_ds.datasets.instruction import InstructionDataset
from lavis_ds.datasets.samplers import EvalBatchSampler
from lavis_ds.apps.export import load_exported
from lavis_ds.apps.generate import main
from lavis_ds.apps.generation import as_trained, eval_processors

storage, new_tokens, world_size, batch_size, folders = Path(sys.argv[1]), *map(int, sys.argv[2:5]), sys.argv[5:]

def rank_batches(num_samples):
    for rank in range(world_size):
        sampler = EvalBatchSampler(num_samples, batch_size, world_size, rank)
        yield [indices for i, indices in enumerate(sampler) if not sampler.is_padding(i)]

def check(folder):
    records = json.loads((storage / "annotations" / "test.json").read_text())
    generated = [None] * len(records)
    for batches in rank_batches(len(records)):
        for indices in batches:
            prompts = {records[i]["instruction"] for i in indices}
            assert len(prompts) == 1, prompts  # the demo asks every test image the same
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                code = main(["--model", folder, "--prompt", prompts.pop(), "--max-new-tokens", str(new_tokens),
                             "--min-new-tokens", str(new_tokens), "--json", "--image",
                             *[str(storage / "images" / records[i]["image"]) for i in indices]])
            assert code == 0
            for i, line in zip(indices, json.loads(stdout.getvalue()), strict=True):
                generated[i] = line["generated"]

    model = load_exported(folder)
    vis, text = eval_processors(folder)
    val = InstructionDataset(storage / "annotations" / "val.json", storage / "images", vis, text)
    totals = torch.zeros(2, dtype=torch.float64)
    for batches in rank_batches(len(val)):  # runners.evaluation.evaluate_loss: per-rank sums, then all_reduce
        rank_totals = torch.zeros(2, dtype=torch.float64)
        for indices in batches:
            batch, context = as_trained(model, val.collater([val[i] for i in indices]))
            with torch.no_grad(), context:
                out = model(batch)
            rank_totals += torch.tensor([float(out["loss_sum"]), float(out["num_tokens"])], dtype=torch.float64)
        totals += rank_totals
    return {"generated": generated, "val_loss": (totals[0] / totals[1].clamp(min=1)).item(),
            "deepspeed_modules": sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed")}

for folder in folders:  # each in a process of its own: what one export imports, the next does not inherit
    sys.stdout.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            answer = json.dumps(check(folder))
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        with os.fdopen(write, "w") as pipe:
            pipe.write(answer)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps({"folder": folder, "exit": code, "result": json.loads(answer) if code == 0 else None}))
"""


@pytest.fixture(scope="module")
def without_deepspeed(request, exported, demo_storage):
    """``without_deepspeed(name)`` -> what a process without DeepSpeed generated and computed from run ``name``'s
    export. On first use, every run the session tests that way is exported and checked in one fresh interpreter
    (one process forked per export): one Python start-up instead of one per run."""
    test = test_export_loads_without_deepspeed_and_generates_what_training_generated
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "function", None) is test]
    done = {}

    def get(name: str) -> dict:
        if name not in done:
            todo = [n for n in names if n not in done] if name in names else [name]
            folders = [str(exported(n)) for n in todo]
            args = [str(demo_storage), str(NEW_TOKENS), str(NPROC), str(BATCH_SIZE_EVAL), *folders]
            proc = subprocess.run([sys.executable, "-c", WITHOUT_DEEPSPEED, *args], cwd=REPO, env=env(),
                                  capture_output=True, text=True, timeout=300 * len(todo))
            assert proc.returncode == 0, proc.stderr[-4000:]
            lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"folder"')]
            assert [line["folder"] for line in lines] == folders, proc.stdout[-2000:] + proc.stderr[-4000:]
            for n, line in zip(todo, lines):
                assert line["exit"] == 0, f"{n}: exit {line['exit']}\n{proc.stderr[-4000:]}"
                done[n] = line["result"]
        return done[name]

    return get


@pytest.mark.parametrize("name", list(RUNS))
def test_export_loads_without_deepspeed_and_generates_what_training_generated(name, trained, without_deepspeed):
    expected_texts, expected_val_loss = _trained_results(trained(name))
    result = without_deepspeed(name)
    assert result["deepspeed_modules"] == [], "loading or generating imported DeepSpeed"
    assert result["generated"] == expected_texts
    # Exact: the same weights in the same dtype on the same batches. Every trained weight and the
    # image path enter the loss (the texts of this briefly trained model hardly depend on the image).
    # Except ZeRO-3, whose forward rounds differently in the last bits (measured 3e-8 relative on this loss,
    # on every run): DeepSpeed runs it through its partitioned-parameter machinery, which can swap in its own
    # matmul-then-add linear (deepspeed/runtime/zero/linear.py) for the fused addmm a plain module runs.
    exact = RUNS[name].get("stage") != 3
    assert result["val_loss"] == (expected_val_loss if exact else pytest.approx(expected_val_loss, rel=1e-6))


def test_exported_keys_are_the_trainable_parameters_only(trained, exported):
    from lavis_ds.apps.export import exported_model_config
    from lavis_ds.build import build_model

    folder = exported("zero1_lora_frozen_vit")
    keys = set(load_file(str(folder / "model.safetensors")))
    model = build_model(exported_model_config(folder), seed=7)
    assert keys == {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_A." in k for k in keys) and any(k.startswith("connector.llm_proj.") for k in keys)
    assert not any(k.startswith("vision_tower.vit.") or ("llm_model." in k and ".lora_" not in k) for k in keys)


def test_exported_tensors_are_the_fp32_master_weights_zero2_bf16(trained, exported):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    step = find_checkpoint(trained("zero2_bf16"))
    weights = load_file(str(exported("zero2_bf16") / "model.safetensors"))
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(step.parent), step.name)
    module = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, consolidated[name]), name
        assert torch.equal(tensor.to(torch.bfloat16), module[name]), name  # the engine's weights are their rounding
    # Masters, not the bf16 weights upcast: somewhere the fp32 value has bits bf16 lacks.
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in weights.values())


def test_exported_tensors_are_the_fp32_master_weights_zero0_bf16(trained, exported):
    step = find_checkpoint(trained("zero0_bf16"))
    states = torch.load(step / "mp_rank_00_model_states.pt", weights_only=False)
    weights = load_file(str(exported("zero0_bf16") / "model.safetensors"))
    flat_masters = torch.cat(states["optimizer"]["fp32_groups_flat"])
    exported_values = torch.cat([t.flatten() for t in weights.values()])
    # The same values, split among the parameters (the order differs: groups are decay / no decay).
    assert torch.equal(exported_values.sort().values, flat_masters.sort().values)
    for name, tensor in weights.items():
        assert torch.equal(tensor.to(torch.bfloat16), states["module"][name]), name
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in weights.values())


def test_untrained_model_generates_differently(trained, exported, demo_storage):
    """The comparison above can fail: without the trained weights the same model says something else."""
    from lavis_ds.build import build_model
    from lavis_ds.apps.export import exported_model_config, read_export_config
    from lavis_ds.apps.generation import eval_processors, generate
    from PIL import Image

    folder = exported("zero2_fp32")
    expected, _ = _trained_results(trained("zero2_fp32"))
    records = json.loads((demo_storage / "annotations" / "test.json").read_text())
    vis, _ = eval_processors(folder)
    images = torch.stack([vis(Image.open(demo_storage / "images" / r["image"]).convert("RGB")) for r in records])
    untrained = build_model(exported_model_config(folder), int(read_export_config(folder).seed)).eval()
    prompts = [r["instruction"] for r in records]
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    assert generate(untrained, images, prompts, **kwargs) != expected
    assert generate(load_exported(folder), images, prompts, **kwargs) == expected


def test_merge_lora_writes_a_plain_llm_and_generates_the_same(trained, exported, tmp_path, demo_storage):
    from lavis_ds.apps.generation import eval_processors, generate
    from PIL import Image
    from transformers import Qwen2ForCausalLM

    folder = export_checkpoint(trained("zero1_lora_frozen_vit"), tmp_path / "merged", merge_lora=True)
    assert not any(k.startswith("llm_model.") for k in load_file(str(folder / "model.safetensors")))
    llm = Qwen2ForCausalLM.from_pretrained(folder / "llm")  # plain transformers: no peft, no lavis_ds
    assert not any("lora" in name for name, _ in llm.named_parameters())

    expected, _ = _trained_results(trained("zero1_lora_frozen_vit"))
    records = json.loads((demo_storage / "annotations" / "test.json").read_text())
    vis, _ = eval_processors(folder)
    images = torch.stack([vis(Image.open(demo_storage / "images" / r["image"]).convert("RGB")) for r in records])
    texts = generate(load_exported(folder), images, [r["instruction"] for r in records],
                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert texts == expected


def _copy_checkpoint(step: Path, dest: Path, complete: bool) -> Path:
    shutil.copytree(step, dest)
    if not complete:
        (dest / COMPLETE_MARKER).unlink()
    return dest


def test_incomplete_checkpoint_is_refused(trained, tmp_path):
    step = find_checkpoint(trained("zero2_fp32"))
    run = tmp_path / "run"
    incomplete = _copy_checkpoint(step, run / "checkpoints" / "step_8", complete=False)
    with pytest.raises(ExportError, match=rf"step_8 is an incomplete checkpoint: it has no {COMPLETE_MARKER}"):
        export_checkpoint(incomplete, tmp_path / "out")
    with pytest.raises(ExportError, match=r"run is not a lavis_ds checkpoint \(only incomplete checkpoints: .*step_8\)"):
        export_checkpoint(run, tmp_path / "out")
    # Beside a complete one: the run dir means the newest complete checkpoint, and the error says which.
    _copy_checkpoint(step, run / "checkpoints" / "step_4", complete=True)
    assert find_checkpoint(run) == run / "checkpoints" / "step_4"
    with pytest.raises(ExportError, match=r"newest complete checkpoint beside it is .*step_4"):
        export_checkpoint(incomplete, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_paths_that_are_not_checkpoints_or_exports_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"empty is not a lavis_ds checkpoint: give a checkpoint folder"):
        export_checkpoint(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ExportError, match=r"nowhere does not exist"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ExportError, match=r"empty is not an export folder: config.yaml and model.safetensors missing"):
        load_exported(tmp_path / "empty")


def test_export_refuses_to_overwrite(trained, exported, tmp_path):
    with pytest.raises(ExportError, match=r"already holds an export: .* --overwrite"):
        export_checkpoint(trained("zero2_fp32"), exported("zero2_fp32"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not an export")
    with pytest.raises(ExportError, match=r"mine exists and is not an export folder"):
        export_checkpoint(trained("zero2_fp32"), tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "not an export"


def _edited_export(folder: Path, dest: Path, edit) -> Path:
    shutil.copytree(folder, dest)
    weights = load_file(str(dest / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dest / "model.safetensors"))
    return dest


def test_strict_accounting_names_missing_unknown_and_misshapen_keys(exported, tmp_path):
    folder = exported("zero2_fp32")
    missing = _edited_export(folder, tmp_path / "missing", lambda w: w.pop("connector.llm_proj.weight"))
    with pytest.raises(ExportError, match=r"1 trainable parameter\(s\) are not in the file .*: "
                                         r"connector\.llm_proj\.weight"):
        load_exported(missing)
    unknown = _edited_export(folder, tmp_path / "unknown",
                             lambda w: w.update({"connector.llm_proj.extra": torch.zeros(2)}))
    with pytest.raises(ExportError, match=r"1 key\(s\) name no parameter of the rebuilt Blip2Qwen: "
                                         r"connector\.llm_proj\.extra"):
        load_exported(unknown)
    shape = _edited_export(folder, tmp_path / "shape",
                           lambda w: w.update({"connector.query_tokens": torch.zeros(1, 2, 3)}))
    with pytest.raises(ExportError, match=r"shape mismatch\(es\) \(file vs model\): connector\.query_tokens "
                                         r"\(1, 2, 3\) vs"):
        load_exported(shape)


def test_export_command_line(trained, tmp_path):
    proc, missing = run_together(  # two independent commands, started together
        [sys.executable, str(REPO / "export.py"), str(trained("zero3_fp32")), "--out", str(tmp_path / "cli")],
        [sys.executable, str(REPO / "export.py"), str(tmp_path / "nowhere"), "--out", str(tmp_path / "cli2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_4 (step 4, ZeRO-3, fp32) ->" in proc.stdout
    assert {p.name for p in (tmp_path / "cli").iterdir()} == {"model.safetensors", "config.yaml", "tokenizer"}
    assert missing.returncode == 2 and "lavis_ds: " in missing.stderr and "nowhere does not exist" in missing.stderr
