"""The precomputed reference of DPO (``objectives.reference.ReferenceStore``) on a tiny real model and the demo's
pairs: a pass cut short continues with the parts it stored (a half-written or damaged part is recomputed), the
complete store holds every pair, and a pair the pass did not score is named instead of given another's numbers."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lavis_ds.common.errors import LavisDsError
from lavis_ds.common.registry import registry
from lavis_ds.datasets.demo_pairs import ensure_demo_pairs
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes
from lavis_ds.models import Blip2Qwen
from lavis_ds.objectives import reference
from lavis_ds.objectives.reference import REF_CHOSEN, ReferenceScorer, ReferenceStore, pair_keys, reference_line

FIXTURES = Path(__file__).parent / "fixtures" / "preference"


class Forwarding:
    """What the pass asks of an engine: ``forward`` (the model's root forward) and ``module``; it counts forwards."""

    def __init__(self, model):
        self.module, self.forwards = model, 0

    def forward(self, batch):
        self.forwards += 1
        return self.module(batch)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    storage = tmp_path_factory.mktemp("demo") / "demo_shapes"
    ensure_demo_shapes(storage, DemoShapesSpec(num_train=8, num_val=2, num_test=2))
    ensure_demo_pairs(storage)
    section = {"build_info": {"storage": str(storage), "num_train": 8, "num_val": 2, "num_test": 2}}
    dataset = registry.get_builder_class("demo_shape_pairs")(section).build()["train"]
    cfg = {**Blip2Qwen.default_config("tiny"), "tokenizer": str(storage / "tokenizer")}
    torch.manual_seed(0)
    return dataset, Blip2Qwen.from_config(cfg).eval()


def test_a_cut_pass_continues_from_its_stored_parts(setting, tmp_path, monkeypatch):
    dataset, model = setting
    monkeypatch.setattr(reference, "PASS_PART", 4)  # 8 pairs: two parts
    first = ReferenceStore(tmp_path)
    engine = Forwarding(model)
    with torch.no_grad():
        full = first.compute(engine, ReferenceScorer(), dataset, 2, 0, 1, "train")
    assert len(full) == 8 and engine.forwards == 4
    (tmp_path / "train_part_00001.pt").write_bytes(b"half a file")  # a part cut while written, or damaged
    again, engine = ReferenceStore(tmp_path), Forwarding(model)
    with torch.no_grad():
        assert again.compute(engine, ReferenceScorer(), dataset, 2, 0, 1, "train") == full
    assert engine.forwards == 2  # part 0 read back, part 1 scored again
    assert not again.load()  # not complete until finish()
    again.finish(0, {"train": {"pairs": 8}})
    assert ReferenceStore(tmp_path).load() and not list(tmp_path.glob("*.tmp"))


def test_a_pair_the_pass_did_not_score_is_named(setting, tmp_path):
    dataset, model = setting
    store = ReferenceStore(tmp_path)
    with torch.no_grad():
        store.compute(Forwarding(model), ReferenceScorer(), dataset, 4, 0, 1, "train")
    pairs = dataset.collater([dataset[0], dataset[1]])
    looked_up = store.lookup(pairs)[REF_CHOSEN]
    assert len(looked_up) == 2 and all(isinstance(v, float) for v in looked_up)  # not cast with the batch
    changed = {**pairs, "image": pairs["image"].clone()}
    changed["image"][1] += 0.01  # another augmentation of the same image
    with pytest.raises(LavisDsError, match=r"pair 1: not in the reference log-probs of .* the train vis_processor "
                                           r"must be deterministic"):
        store.lookup(changed)


def test_the_pass_counts_records_beside_distinct_pairs_and_keys_each_pairs_own_system_turn(setting, tmp_path):
    """ms-swift's two quoted pairs, each twice, and the first again with another system turn: 5 records, 3 distinct
    contents scored once each; the line the pass prints counts the records."""
    _, model = setting
    weather, math = (FIXTURES / "swift_rlhf_text.jsonl").read_text().splitlines()
    terse = json.loads(weather)
    terse["messages"][0]["content"] = "You are a terse assistant"
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join([weather, math, weather, math, json.dumps(terse)]) + "\n")
    section = {"pair_format": "swift", "build_info": {"annotations": {"train": {"storage": str(path)}},
                                                      "images": {"storage": str(tmp_path)}}}
    dataset = registry.get_builder_class("preference_pairs")(section).build()["train"]
    with torch.no_grad():
        scored = ReferenceStore(tmp_path / "store").compute(Forwarding(model), ReferenceScorer(), dataset, 4, 0, 1,
                                                            "train")
    assert len(dataset) == 5 and len(scored) == 3
    first, again, other_system = pair_keys(dataset.collater([dataset[0], dataset[2], dataset[4]]))
    assert first == again != other_system and scored[first] != scored[other_system]
    line = reference_line({"pairs": len(dataset), "distinct": len(scored),
                           "logps/accuracies": reference.preference_accuracy(scored)})
    assert re.fullmatch(r"the starting model prefers the chosen answer of [01]\.\d{3} of 5 pairs \(3 distinct\)", line)
