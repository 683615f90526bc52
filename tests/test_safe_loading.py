"""Reading a checkpoint runs no code: a crafted file in a run folder, an export or a published checkpoint is
refused with one ``lavis_ds:`` message naming the file and what it asked to build, and its payload never runs.

The checkpoints are two real one-process runs (ZeRO-2 and FSDP2, a few steps each, trained side by side once for
the module); each case copies one, plants a payload in one file the way an attacker would (the file's real content
plus an object whose unpickling writes a marker file) and comes in as a user does: resuming (the resume plan the
trainer makes first), exporting (``export.py``'s main), loading an export (what chat, generate and the web page
call), a model's ``pretrained`` file, or another engine taking the run over.
"""
from __future__ import annotations

import io
import pathlib
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import demo_storage_fixture
from harness import REPO
from run_utils import output_of, start, tiny_config, write_yaml

demo_storage = demo_storage_fixture(num_train=8, num_val=8, num_test=8)

RUNS = {"runner_deepspeed": {"zero_stage": 2}, "runner_fsdp": {"runner": "runner_fsdp"}}
STEP = "step_2"  # 8 samples, micro-batches of 4, one process: the checkpoint at the end of the epoch


class Payload:
    """Unpickled, it writes ``marker``: what a crafted file would do with ``os.system`` instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.write_text, (self.marker, "the payload ran")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_storage) -> dict[str, Path]:
    """Each engine's run folder (one process, 2 steps, a checkpoint at the end), trained side by side."""
    root = tmp_path_factory.mktemp("safe_runs")
    jobs, folders = {}, {}
    for runner, keys in RUNS.items():
        folders[runner] = root / runner
        cfg = tiny_config(folders[runner], demo_storage, stage=keys.get("zero_stage", 2), max_epoch=1,
                          **{k: v for k, v in keys.items() if k != "zero_stage"})
        jobs[runner] = start(write_yaml(root / f"{runner}.yaml", cfg), nproc=0)
    for runner, job in jobs.items():
        assert job.wait(timeout=600) == 0, output_of(job)[-4000:]
        assert (folders[runner] / "checkpoints" / STEP / "lavis_ds_complete.json").is_file()
    return folders


@pytest.fixture(scope="module")
def model(runs):
    """The runs' model (both engines train the same one), built as the runs built it."""
    from lavis_ds.build import build_model
    from lavis_ds.config import load_config

    cfg = load_config(runs["runner_deepspeed"] / "config.yaml")
    return build_model(cfg.model, cfg.run.seed)


def _copy_run(run: Path, dest: Path) -> Path:
    """The run's config and checkpoint in a fresh output folder (what a user downloads); returns the step folder."""
    shutil.copytree(run / "checkpoints" / STEP, dest / "checkpoints" / STEP)
    shutil.copy(run / "config.yaml", dest / "config.yaml")
    return dest / "checkpoints" / STEP


def _plant(path: Path, marker: Path) -> None:
    """Put a payload into ``path`` beside its real content (a torch file: one more key; DCP's raw-pickle index: the
    payload itself), and check that an unrestricted read of it would run it."""
    if path.name == ".metadata":
        path.write_bytes(pickle.dumps(Payload(marker)))
        reader = pickle.loads
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)  # the test's own file, not a user's
        torch.save({**state, "note": Payload(marker)} if isinstance(state, dict) else Payload(marker), path)
        reader = None
    # The payload is live: an unrestricted read runs it (so its absence below means it was refused, not broken).
    if reader is None:
        torch.load(path, weights_only=False)
    else:
        reader(path.read_bytes())
    assert marker.read_text() == "the payload ran"
    marker.unlink()


REFUSED = r"refused: it asks to build .*(getattr|Path\.write_text).*no checkpoint of tensors holds"


def _refused(path: Path) -> str:
    return re.escape(str(path)) + ": " + REFUSED


# ------------------------------------------------------------------------------------------ resuming
RESUMED_FILES = [("runner_deepspeed", "rng_state_rank0.pt"),  # the RNG states
                 ("runner_deepspeed", "mp_rank_00_model_states.pt"),  # model states and the loop's client state
                 ("runner_deepspeed", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),  # optimizer states
                 ("runner_fsdp", "client_state.pt"),  # FSDP's client state
                 ("runner_fsdp", ".metadata")]  # DCP's index, a raw pickle


@pytest.mark.parametrize("runner,name", RESUMED_FILES)
def test_resume_refuses_a_payload_and_runs_none(runs, model, tmp_path, runner, name):
    """``run.resume: auto`` (the default) stops on the crafted checkpoint: it neither runs the payload nor sets the
    checkpoint aside as damaged to take an older one."""
    from lavis_ds.common.registry import engines
    from lavis_ds.config import load_config
    from lavis_ds.runners import checkpoint as ckpt
    from lavis_ds.runners.resume import plan_resume

    tag_dir = _copy_run(runs[runner], tmp_path / "run")
    marker = tmp_path / "marker"
    _plant(tag_dir / name, marker)
    cfg = load_config(tmp_path / "run" / "config.yaml", options=[f"run.output_dir={tmp_path / 'run'}"])
    engine = engines.get(runner)(cfg.run, model, tmp_path / "run" / "checkpoints")
    with pytest.raises(ckpt.CheckpointError, match="run.resume=auto: " + _refused(tag_dir / name)):
        plan_resume(engine, cfg.run, engine.checkpoint_dir)
    assert not marker.exists()
    assert tag_dir.is_dir() and ckpt.is_complete(tag_dir)  # not set aside: the user decides


# ------------------------------------------------------------------------------------------ exporting
@pytest.mark.parametrize("runner,name", [("runner_deepspeed", "mp_rank_00_model_states.pt"),
                                         ("runner_deepspeed", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                         ("runner_fsdp", "client_state.pt"), ("runner_fsdp", ".metadata")])
def test_export_refuses_a_payload_in_one_line(runs, tmp_path, capsys, runner, name):
    from lavis_ds.apps.export import main

    tag_dir = _copy_run(runs[runner], tmp_path / "run")
    marker = tmp_path / "marker"
    _plant(tag_dir / name, marker)
    assert main([str(tag_dir), "--out", str(tmp_path / "export")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.match("lavis_ds: " + _refused(tag_dir / name), lines[0]), lines
    assert not marker.exists() and not (tmp_path / "export").exists()


def test_loading_an_export_refuses_a_pickle_in_place_of_its_weights(runs, tmp_path):
    """What chat, generate and the web page call (``load_exported``) reads safetensors only."""
    from lavis_ds.apps.export import WEIGHTS_FILE, export_checkpoint, load_exported
    from lavis_ds.common.safe_files import UnsafeFile

    folder = export_checkpoint(runs["runner_deepspeed"], tmp_path / "export")
    weights, marker = folder / WEIGHTS_FILE, tmp_path / "marker"
    torch.save({"state": {}, "note": Payload(marker)}, weights)  # a crafted "model.safetensors"
    with pytest.raises(UnsafeFile, match=_refused(weights) + r".*a safetensors file holds no pickle at all"):
        load_exported(folder)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ published files
@pytest.mark.parametrize("suffix", [".pth", ".bin"])
def test_a_published_checkpoint_with_a_payload_is_refused(model, tmp_path, suffix):
    """``model.pretrained``: a LAVIS BLIP-2 ``.pth`` (or a ``.bin``) carrying a payload beside its weights."""
    from lavis_ds.common.safe_files import UnsafeFile

    path, marker = tmp_path / f"blip2_pretrained{suffix}", tmp_path / "marker"
    torch.save({"model": {"query_tokens": torch.zeros(1, 4, 8)}, "note": Payload(marker)}, path)
    with pytest.raises(UnsafeFile, match=_refused(path)):
        model.load_from_pretrained(str(path))
    assert not marker.exists()


def test_a_published_llm_folder_with_a_payload_in_its_bin_is_refused(demo_storage, tmp_path):
    """``model.llm_model``: a Hugging Face folder whose ``pytorch_model.bin`` carries a payload (transformers reads
    it with weights_only; lavis_ds names the file)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from lavis_ds.common.safe_files import UnsafeFile
    from lavis_ds.models.llm import build_llm

    folder, marker = tmp_path / "llm", tmp_path / "marker"
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    config.save_pretrained(folder)
    torch.save({**Qwen2ForCausalLM(config).state_dict(), "note": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(UnsafeFile, match=_refused(folder / "pytorch_model.bin")):
        build_llm(folder, None, None, AutoTokenizer.from_pretrained(demo_storage / "tokenizer"))
    assert not marker.exists()


# ---------------------------------------------------------------------------- the libraries' own readers
def test_deepspeeds_own_loader_is_restricted_inside_library_reads(runs, tmp_path):
    """DeepSpeed's engine.load_checkpoint reads through its checkpoint engine, which asks torch for an unrestricted
    load; inside library_reads it gets weights_only anyway, with DeepSpeed's classes allowed."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from lavis_ds.common.safe_files import UnsafeFile
    from lavis_ds.runners.deepspeed.checkpoint import library_reads

    tag_dir = _copy_run(runs["runner_deepspeed"], tmp_path / "run")
    optimizer_states = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with library_reads(tag_dir):  # DeepSpeed's own classes load
        state = TorchCheckpointEngine().load(str(optimizer_states), map_location="cpu")
    assert isinstance(state["optimizer_state_dict"]["loss_scaler"], LossScaler)
    marker = tmp_path / "marker"
    _plant(optimizer_states, marker)
    with pytest.raises(UnsafeFile, match=_refused(optimizer_states)), library_reads(tag_dir):
        TorchCheckpointEngine().load(str(optimizer_states), map_location="cpu")
    assert not marker.exists()


def test_fp16s_dynamic_loss_scaler_loads(tmp_path):
    """fp16 (not trainable on this CPU) pickles DeepSpeed's DynamicLossScaler into the optimizer states: allowed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from lavis_ds.runners.deepspeed.checkpoint import load_file

    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler}}, tmp_path / "optim_states.pt")
    loaded = load_file(tmp_path / "optim_states.pt")["optimizer_state_dict"]["loss_scaler"]
    assert isinstance(loaded, DynamicLossScaler) and vars(loaded) == vars(scaler)


def test_a_payload_in_a_dcp_entry_is_refused_when_another_engine_takes_the_run_over(runs, tmp_path):
    """DCP unpickles a non-tensor entry (an optimizer hyper-parameter) of a ``.distcp`` file unrestricted; read for
    a switch of engines, one whose bytes are a payload is refused."""
    from lavis_ds.common.safe_files import UnsafeFile
    from lavis_ds.runners.fsdp.checkpoint import FSDPCheckpoints

    tag_dir = _copy_run(runs["runner_fsdp"], tmp_path / "run")
    marker = tmp_path / "marker"
    index = pickle.loads((tag_dir / ".metadata").read_bytes())  # the test's own file
    key = next(k for k in index.storage_data if k.fqn.startswith("optim.param_groups."))
    info = index.storage_data[key]
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    with open(tag_dir / info.relative_path, "ab") as data:
        info.offset, info.length = data.tell(), data.write(payload.getvalue())
    (tag_dir / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(UnsafeFile, match=re.escape(str(tag_dir)) + ": " + REFUSED.split(".*no")[0]):
        FSDPCheckpoints.read_handover(tag_dir, tmp_path / "scratch", rank=0)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ the package
def test_the_package_asks_for_no_unrestricted_load_and_no_remote_code():
    """Every file lavis_ds reads goes through safe_files; trust_remote_code is never set on the user's behalf."""
    unsafe = re.compile(r"weights_only\s*=\s*False|pickle\.load\(|trust_remote_code")
    found = [f"{path.relative_to(REPO)}:{number}" for path in sorted((REPO / "lavis_ds").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if unsafe.search(line)]
    assert found == []
