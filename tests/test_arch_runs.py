"""Every composed architecture through the engines, on real processes: one packed ZeRO-2 run on 2 processes is
SIGKILLed and continues bit for bit; its checkpoint continues under FSDP2 on 1 process (the engine switch and an
elastic resume), and that one under ZeRO-3 on 2 processes (the LLM built partitioned), each step the uninterrupted
run's. blip2_qwen has these as dedicated tests (test_resume, test_fsdp, test_packing, test_partitioned_build)."""
from __future__ import annotations

import random

import pytest

from archs import ARCHITECTURES, tiny_model_section, without_dropout
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import (assert_same_steps, comparable, continue_from, kill_after_step, output_of, run_train, start,
                       tiny_config, train_steps, write_yaml)

# blip2_qwen has these as dedicated tests (the module docstring).
COMPOSED = [arch for arch in ARCHITECTURES if arch != "blip2_qwen"]
SAVE_EVERY = 3
SYSTEM_PROMPT = "You are a helpful assistant."


def _config(out, storage, arch, runner="runner_deepspeed", stage=2, max_epoch=3) -> dict:
    """A packed run (token budget of 2 x 256 per process and step) of ``arch``'s tiny preset, dropout off, with a
    schedule that does not depend on max_epoch (continuations run fewer epochs)."""
    cfg = tiny_config(out, storage, stage=stage, micro=1, max_epoch=max_epoch, runner=runner, packing=True,
                      max_seq_len=256, save_freq_steps=SAVE_EVERY, lr_sched="linear_warmup_step_lr",
                      lr_decay_rate=0.5)
    cfg["datasets"]["demo_shapes"]["build_info"].update(num_train=32, num_val=4, num_test=4)
    # One system prompt for all (Qwen3.5's preset has none): about as many samples per packed step, so that each
    # run is long enough for the kill, the checkpoints and the continuations below.
    cfg["model"] = tiny_model_section(arch, storage / "tokenizer", storage, system_prompt=SYSTEM_PROMPT,
                                      **without_dropout(arch))
    return cfg


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return ensure_demo_shapes(tmp_path_factory.mktemp("demo") / "demo_shapes",
                              DemoShapesSpec(num_train=32, num_val=4, num_test=4))


@pytest.fixture(scope="module")
def killed_and_reference(tmp_path_factory, storage, request):
    """Per architecture: the uninterrupted ZeRO-2 run, and the same run SIGKILLed after a random step and rerun."""
    runs = {}

    def run(arch):
        if arch not in runs:
            root = tmp_path_factory.mktemp(arch)
            reference_out, killed_out = root / "reference", root / "killed"
            reference = start(write_yaml(root / "reference.yaml", _config(reference_out, storage, arch)))
            killed_cfg = write_yaml(root / "killed.yaml", _config(killed_out, storage, arch))
            kill_step = random.randint(SAVE_EVERY + 1, 2 * SAVE_EVERY + 1)
            kill_after_step(start(killed_cfg), killed_out, kill_step)
            rerun = run_train(killed_cfg)
            assert reference.wait(timeout=600) == 0, output_of(reference)[-4000:]
            runs[arch] = root, reference_out, killed_out, kill_step, rerun
        return runs[arch]
    return run


@pytest.mark.parametrize("arch", COMPOSED)
def test_a_killed_packed_zero2_run_continues_bit_for_bit(arch, killed_and_reference):
    root, reference_out, killed_out, kill_step, rerun = killed_and_reference(arch)
    expected = comparable(train_steps(reference_out))
    assert len(expected) >= 3 * SAVE_EVERY
    assert "resumed from" in rerun.stdout, f"kill after step {kill_step}: no resume\n{rerun.stdout[-2000:]}"
    assert comparable(train_steps(killed_out)) == expected, f"killed after step {kill_step}"
    logged = train_steps(reference_out)
    assert max(m["padding_share"] for m in logged) < 0.5  # packed rows, not padded samples
    assert all(m["tflops_per_device"] > 0 for m in logged)  # the architecture's FLOP model feeds the MFU fields


@pytest.mark.parametrize("arch", COMPOSED)
def test_a_zero2_checkpoint_continues_under_fsdp_on_one_process_then_zero3(arch, killed_and_reference, storage):
    root, reference_out, _, _, _ = killed_and_reference(arch)
    steps = len(train_steps(reference_out))
    saved = reference_out / "checkpoints" / f"step_{SAVE_EVERY}"
    fsdp_out, zero3_out = root / "fsdp", root / "zero3"
    fsdp_cfg = write_yaml(root / "fsdp.yaml", _config(fsdp_out, storage, arch, runner="runner_fsdp", max_epoch=2))
    proc = continue_from(saved, fsdp_cfg, fsdp_out, nproc=0)
    assert "under runner_fsdp" in proc.stdout, proc.stdout[-3000:]
    fsdp_steps = len(train_steps(fsdp_out)) + SAVE_EVERY
    assert SAVE_EVERY < fsdp_steps < steps  # it trained, and left the last epoch to the next engine
    assert_same_steps(fsdp_out, reference_out, range(SAVE_EVERY + 1, fsdp_steps + 1), 1e-5)

    last = max((fsdp_out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    zero3_cfg = write_yaml(root / "zero3.yaml", _config(zero3_out, storage, arch, stage=3))
    assert int(last.name.split("_")[1]) == fsdp_steps
    proc = continue_from(last, zero3_cfg, zero3_out)
    assert "under runner_deepspeed" in proc.stdout, proc.stdout[-3000:]
    assert_same_steps(zero3_out, reference_out, range(int(last.name.split("_")[1]) + 1, steps + 1), 1e-5)
