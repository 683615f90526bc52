"""python -m lavis_ds.show_sample: one sample of the run's real dataset, rendered and marked up, with its counts."""
from __future__ import annotations

import json
import re

import pytest

from families import FAMILIES, tokenizer_dir
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from lavis_ds.show_sample import main
from run_utils import tiny_config, write_yaml


@pytest.fixture(scope="module")
def run_yaml(tmp_path_factory):
    root = tmp_path_factory.mktemp("show_sample")
    storage = ensure_demo_shapes(root / "demo_shapes", DemoShapesSpec(num_train=8, num_val=2, num_test=2))
    cfg = tiny_config(root / "out", storage)
    return write_yaml(root / "run.yaml", cfg), storage


def record(storage, index: int) -> dict:
    return json.loads((storage / "annotations" / "train.json").read_text())[index]


def multi_turn_index(storage) -> int:
    records = json.loads((storage / "annotations" / "train.json").read_text())
    return next(i for i, r in enumerate(records) if isinstance(r["output"], list) and len(r["output"]) > 1)


def marked(out: str) -> list[str]:
    """The supervised runs of the rendered prompt (between the header's blank line and the counts)."""
    return re.findall(r"\[\[(.*?)\]\]", out.split("\n\n", 1)[1], flags=re.S)


def shown(capsys, *argv: str) -> str:
    assert main(["--color", "never", *argv]) == 0
    return capsys.readouterr().out


def test_shows_the_chatml_prompt_with_the_answers_marked_and_the_image_collapsed(run_yaml, capsys):
    cfg, storage = run_yaml
    index = multi_turn_index(storage)
    out = shown(capsys, "--cfg-path", str(cfg), "--index", str(index))
    answers = record(storage, index)["output"]
    assert f"sample: datasets.demo_shapes train[{index}]  image: {record(storage, index)['image']}" in out
    assert "<Img><image x8></Img>" in out  # the tiny preset's 8 queries
    assert marked(out) == [f"{a}<|im_end|>" for a in answers]
    assert "chat template of tokenizer" in out and "answer mask from prefix renders" in out
    total, image, supervised = map(int, re.search(r"tokens: (\d+) total, (\d+) image, (\d+) supervised", out).groups())
    assert image == 8 and total > image + supervised > image


def test_shows_another_family_through_options(run_yaml, capsys, tmp_path):
    cfg, storage = run_yaml
    llama = tokenizer_dir(tmp_path / "llama", "llama3.2")
    out = shown(capsys, "--cfg-path", str(cfg), "--index", "0", "--options", f"model.tokenizer={llama}",
                "model.llm_config.model_type=llama", f"model.image_token={FAMILIES['llama3.2'].model['image_token']}",
                "model.chat_template_kwargs.date_string=26 Jul 2024")
    assert "Today Date: 26 Jul 2024" in out and "<|start_header_id|>assistant<|end_header_id|>\n\n[[" in out
    assert marked(out) == [f"{record(storage, 0)['output']}<|eot_id|>"]


def test_bad_index_or_split_is_named(run_yaml, capsys):
    cfg, _ = run_yaml
    assert main(["--cfg-path", str(cfg), "--index", "99"]) == 2
    assert "--index 99: datasets.demo_shapes split 'train' has 8 samples" in capsys.readouterr().err
    assert main(["--cfg-path", str(cfg), "--split", "nope"]) == 2
    assert "--split 'nope': no split of that name in datasets demo_shapes" in capsys.readouterr().err


def test_a_preference_pair_shows_both_sides_with_their_last_answers_supervised(run_yaml, capsys, tmp_path):
    from lavis_ds.datasets.demo_pairs import ensure_demo_pairs

    cfg_path, storage = run_yaml
    ensure_demo_pairs(storage)
    pairs = json.loads((storage / "pairs" / "train.json").read_text())
    index = next(i for i, p in enumerate(pairs) if len(p["conversations"]) > 1)  # a multi-turn pair
    cfg = tiny_config(tmp_path / "out", storage, task="dpo")
    cfg["datasets"] = {"demo_shape_pairs": {"build_info": {"storage": str(storage), "num_train": 8, "num_val": 2,
                                                           "num_test": 2}}}
    out = shown(capsys, "--cfg-path", str(write_yaml(tmp_path / "dpo.yaml", cfg)), "--index", str(index))
    chosen, rejected = out.split("\n\nsample: ")
    assert f"sample: datasets.demo_shape_pairs train[{index}] (chosen)" in chosen
    assert rejected.startswith(f"datasets.demo_shape_pairs train[{index}] (rejected)")
    earlier = pairs[index]["conversations"][1]["value"]  # an earlier answer: prompt of both sides, not supervised
    for side, text in (("chosen", chosen), ("rejected", "sample: " + rejected)):
        assert marked(text) == [f"{pairs[index][side]['value']}<|im_end|>"]
        assert f"{earlier}<|im_end|>" in text
