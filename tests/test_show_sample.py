"""python -m lavis_ds.show_sample: one sample of the run's real dataset, rendered and marked up, with its counts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

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


# ---- show-sample's ids are the ids the training forward receives ----------------------------------------
CHAT_FIXTURES = Path(__file__).parent / "fixtures" / "chat_messages"
PAIR_FIXTURES = Path(__file__).parent / "fixtures" / "preference"


def _section(builder: str, annotations: Path, images: Path, **more) -> dict:
    eval_64 = {"train": {"name": "blip2_image_eval", "image_size": 64}, "eval": {"name": "blip2_image_eval",
                                                                                 "image_size": 64}}
    return {"builder": builder, "vis_processor": eval_64, **more,
            "build_info": {"annotations": {"train": {"storage": str(annotations)}}, "images": {"storage": str(images)},
                           "max_frames": 3}}


@pytest.fixture(scope="module")
def every_kind(run_yaml, tmp_path_factory):
    """An SFT and a DPO run over every kind of sample the tests have: demo images, the quoted chat records with and
    without system turns (text-only, one image, two images), LLaVA text-only and several-image records, a video,
    and preference pairs (demo pairs, the quoted pairs with system turns)."""
    from lavis_ds.datasets.demo_pairs import ensure_demo_pairs
    from test_images_per_sample import LLAVA_MULTI_IMAGE, MIX665K_TEXT_ONLY, MPP_VIDEO, write_data, write_json

    _, storage = run_yaml
    ensure_demo_pairs(storage)
    root = tmp_path_factory.mktemp("every_kind")
    media = write_data(root / "media", video_frames=5)
    for name in ("mllm_demo_data/1.jpg", "mllm_demo_data/2.jpg"):
        (media / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30), "purple").save(media / name)
    chat = root / "chat.jsonl"
    chat.write_text((CHAT_FIXTURES / "swift_sft_en.jsonl").read_text() + "".join(
        json.dumps(r) + "\n" for name in ("llamafactory_mllm_demo.json", "llamafactory_sharegpt_system_column.json")
        for r in json.loads((CHAT_FIXTURES / name).read_text())))
    sft = tiny_config(root / "out", storage)
    sft["model"]["max_txt_len"] = 2048
    sft["datasets"].update(
        chat=_section("chat_messages", chat, media),
        llava=_section("llava_conversation", write_json(root / "llava.json", [MIX665K_TEXT_ONLY, LLAVA_MULTI_IMAGE]),
                       media),
        video=_section("videochatgpt_100k", write_json(root / "video.json", [MPP_VIDEO]), media))
    dpo = tiny_config(root / "out", storage, task="dpo")
    dpo["model"]["max_txt_len"] = 2048
    dpo["datasets"] = {
        "demo_shape_pairs": {"build_info": {"storage": str(storage), "num_train": 8, "num_val": 2, "num_test": 2}},
        "sharegpt": _section("preference_pairs", PAIR_FIXTURES / "llamafactory_dpo_en_demo.json", media),
        "swift": _section("preference_pairs", PAIR_FIXTURES / "swift_rlhf_text.jsonl", media, pair_format="swift")}
    return write_yaml(root / "sft.yaml", sft), write_yaml(root / "dpo.yaml", dpo)


def _model_ids(model, dataset, index: int, pack_to: int | None = None) -> list[list[int]]:
    """The ids the training forward receives for sample ``index``: collated, prepared by the model (a pair by the
    preference objective's preparation), padding dropped."""
    from lavis_ds.objectives import model_calls

    batch = dataset.collater([dataset[index]])
    prepared = (model_calls.prepare_pairs(model, batch) if "chosen" in batch
                else model.prepare_batch(batch, pack_to=pack_to))
    return [row[mask.bool()].tolist() for row, mask in zip(prepared["input_ids"], prepared["attention_mask"])]


def _trains(model, batch, pack_to):
    """A training step's forward and backward on the batch: a finite loss in the graph of the trainable weights (a
    text-only sample gives them zero gradient with the LLM frozen: docs/data.md)."""
    from lavis_ds.objectives import Simpo

    prepared = Simpo().prepare(model, batch) if "chosen" in batch else model.prepare_batch(batch, pack_to=pack_to)
    model.zero_grad()
    out = model(prepared)
    loss = out["loss"] if "loss" in out else sum(out["loss_sums"].values())  # an objective's summed losses
    loss.backward()
    assert torch.isfinite(loss) and loss > 0 and model.connector.llm_proj.weight.grad is not None


@pytest.mark.parametrize("run, packing", [("sft", False), ("sft", True), ("dpo", False)])
def test_show_sample_shows_the_ids_the_training_forward_receives(every_kind, run, packing, capsys):
    """Every sample of every section: show-sample's ids equal the model's, and the text-only, own-system and
    several-image samples show what they are."""
    from omegaconf import OmegaConf

    from lavis_ds.build import build_datasets, build_model
    from lavis_ds.config import load_config
    from lavis_ds.show_sample import parse_args, sample_source, training_sequences

    yaml_path = str(every_kind[run == "dpo"])
    options = ["run.packing=true", "run.max_seq_len=4096"] if packing else []
    cfg = load_config(yaml_path, options)
    model = build_model(cfg.model).eval()
    kinds, trained = set(), set()
    for name, splits in build_datasets(cfg.datasets).items():
        dataset = splits["train"]
        # show-sample's own reading of the config and the section (once per section: it takes a second)
        prompt, shown_set, where, _, pack_to = sample_source(parse_args(
            ["--cfg-path", yaml_path, "--dataset", name, *(["--options", *options] if options else [])]))
        for index in range(min(len(dataset), 4)):
            shown = training_sequences(prompt, shown_set, index, where, pack_to)
            assert [s.ids for s in shown] == _model_ids(model, dataset, index, 4096 if packing else None), (name, index)
            assert all(s.packed == packing for s in shown)
            images = dataset[index]["num_images"] * model.image_path.layout.tokens_per_image
            assert all(s.ids.count(model.llm.prompt.image_token_id) == images for s in shown)
            text = model.llm.tokenizer.decode(shown[0].ids)
            system = dataset[index]["system"]
            if system is not None:
                assert f"<|im_start|>system\n{system}<|im_end|>" in text and "helpful assistant" not in text
                if name not in trained and not packing:  # once per section: it trains on the ids compared above
                    _trains(model, dataset.collater([dataset[index]]), None)
                    trained.add(name)
            kinds.add((images > 0, dataset[index]["num_images"] > 1, system is not None))
    # text-only, one image, several images (or frames); with and without a system turn of the record's own
    assert kinds >= ({(False, False, True), (True, False, False), (True, True, False)} if run == "sft"
                     else {(False, False, True), (True, False, False)})


def test_a_text_only_record_shows_no_image(every_kind, capsys):
    sft, _ = every_kind
    out = shown(capsys, "--cfg-path", str(sft), "--dataset", "chat", "--index", "1")
    assert "<image x" not in out and re.search(r"tokens: \d+ total, 0 image", out)
    assert "<|im_start|>system\nYou are a useful and harmless math calculator<|im_end|>" in out
    assert "You are a helpful assistant." not in out
