"""Bad input to a composed architecture's parts, through train.py: each gives one `lavis_ds:` line naming the key and
what would be valid, exit code 2, no traceback. The cases are data (PART_CASES); they run together, each its own
`python train.py` on the tiny preset of the architecture it names."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import pytest
import torch

from archs import tiny_model_section
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from run_utils import run_train, tiny_config, tracebacks, write_yaml

CLIP_WIDTH = 32  # the clip tower's tiny preset


def siglip_folder(root: Path) -> str:
    """A tiny SigLIP vision folder as SiglipVisionModel.save_pretrained writes it."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, image_size=56, patch_size=14)).save_pretrained(
        root / "siglip")
    return str(root / "siglip")


def llava_folder(root: Path) -> str:
    """A tiny published LLaVA folder whose tower (48 wide) and LLM (96 wide) are not the tiny preset's."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              image_size=56, patch_size=14)
    text = Qwen2Config(hidden_size=96, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128)
    LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=127)
                                  ).save_pretrained(root / "llava")
    return str(root / "llava")


# name: (architecture, the model section's change given the case folder, the one line it must print)
PART_CASES: dict[str, tuple[str, Callable[[Path], dict], str]] = {
    "a SigLIP folder where CLIP is configured": (
        "llava", lambda d: {"vision_tower": {"pretrained": siglip_folder(d)}},
        r"^  - model\.vision_tower\.pretrained: .*config\.json has model_type 'siglip_vision_model', but the "
        r"clip tower reads model_type 'clip' or 'clip_vision_model'.*use vision tower 'siglip'"),
    "an image size the tower cannot take": (
        "llava", lambda d: {"vision_tower": {"image_size": 60}},
        r"^  - model\.vision_tower\.image_size: 60 is a size the clip tower cannot take; it takes 64 only"),
    "an InstructBLIP without its Q-Former tokenizer": (
        "instructblip", lambda d: {"connector": {"qformer_tokenizer": None}},
        r"lavis_ds: .*connector\.qformer_tokenizer: required: a local folder with the Q-Former's BERT tokenizer"),
    "a connector name typo": (
        "llava", lambda d: {"connector": {"name": "mlp2x_gelo"}},
        r"^  - model\.connector\.name: Unknown connector 'mlp2x_gelo'\. Did you mean 'mlp2x_gelu'\? Known "),
    "a published folder whose parts do not fit the configured ones": (
        "llava", lambda d: {"pretrained": llava_folder(d), "load_pretrained": True},
        r"lavis_ds: model\.pretrained: .*llava.*vision tower.*hidden_size"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("part_mutations")
    storage = ensure_demo_shapes(root / "demo_shapes", DemoShapesSpec(num_train=8, num_val=2, num_test=2))
    commands = []
    for i, (name, (arch, change, _)) in enumerate(PART_CASES.items()):
        case = root / f"case{i}"
        case.mkdir()
        cfg = tiny_config(case / "out", storage, micro=2)
        cfg["datasets"]["demo_shapes"]["build_info"].update(num_train=8, num_val=2, num_test=2)
        cfg["model"] = tiny_model_section(arch, storage / "tokenizer", storage, **change(case))
        commands.append((name, write_yaml(case / "run.yaml", cfg), case))
    with ThreadPoolExecutor(3) as pool:
        procs = pool.map(lambda c: run_train(c[1], nproc=0, check=False, cwd=c[2]), commands)
        return {name: proc for (name, _, _), proc in zip(commands, procs)}


@pytest.mark.parametrize("name", PART_CASES)
def test_one_problem_line_and_no_traceback(outcomes, name):
    """The config check's one problem (under its `lavis_ds: 1 problem(s) in ...` heading), or the build's one
    `lavis_ds:` line: exit 2, no traceback."""
    proc = outcomes[name]
    context = f"{name}: exit {proc.returncode}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 2 and not tracebacks(proc.stdout + proc.stderr), context
    headed = re.fullmatch(r"lavis_ds: 1 problem\(s\) in \S+:\n(  - .*)\n?", proc.stderr.strip() + "\n")
    lines = [headed.group(1)] if headed else [line for line in proc.stderr.splitlines() if line.startswith("lavis_ds: ")]
    assert len(lines) == 1 and re.search(PART_CASES[name][2], lines[0]), context
