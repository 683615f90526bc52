"""Mixing datasets by `sample_ratio`: exact integer shares, ratios over an epoch, the order's dependence on seed and
epoch only (not on the world size or the DataLoader's workers), and a real run of two mixed dataset sections.
"""
from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from torch.utils.data import DataLoader, Dataset

from lavis_ds.datasets import MixedDataset, mix_train_splits
from lavis_ds.datasets.demo_shapes import CAPTION_PROMPT, DemoShapesSpec, ensure_demo_shapes
from lavis_ds.datasets.mixing import apportion
from lavis_ds.datasets.samplers import StepBatchSampler
from run_utils import REPO, command, env, metrics, tiny_config, write_yaml


def _json(path: Path, content) -> Path:
    path.write_text(json.dumps(content))
    return path


class Tagged(Dataset):
    """A real dataset of (name, index) items, so a mixed epoch shows where each sample came from."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if not 0 <= index < self.size:
            raise IndexError(index)
        return self.name, index

    @staticmethod
    def collater(samples):
        return list(samples)


def _epoch_items(mixed: MixedDataset, epoch: int) -> list[tuple[str, int]]:
    mixed.set_epoch(epoch)
    return [mixed[i] for i in range(len(mixed))]


def test_apportion_gives_exact_integer_shares():
    assert apportion(40, {"a": 3, "b": 1}) == {"a": 30, "b": 10}
    assert apportion(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}  # a tie goes to the first
    assert sum(apportion(1001, {"x": 0.3, "y": 2.9, "z": 1.1}).values()) == 1001


def test_ratios_are_respected_over_an_epoch_with_oversampling_in_whole_passes():
    small, large = Tagged("small", 10), Tagged("large", 30)
    mixed = MixedDataset({"small": small, "large": large}, {"small": 3, "large": 1}, seed=5)
    assert len(mixed) == 40 and mixed.shares == {"small": 30, "large": 10}
    items = _epoch_items(mixed, 0)
    per_dataset = Counter(name for name, _ in items)
    assert per_dataset == {"small": 30, "large": 10}
    # Oversampled: every small record exactly 3 times. Undersampled: 10 distinct large records...
    assert Counter(i for name, i in items if name == "small") == {i: 3 for i in range(10)}
    assert len({i for name, i in items if name == "large"}) == 10
    # ... and three epochs cover the large dataset once, without repeats (one pass).
    seen = [i for e in range(3) for name, i in _epoch_items(mixed, e) if name == "large"]
    assert sorted(seen) == list(range(30))


def test_same_seed_and_epoch_give_the_same_samples_other_epochs_and_seeds_other_ones():
    def make(seed):
        return MixedDataset({"a": Tagged("a", 25), "b": Tagged("b", 7)}, {"a": 1, "b": 1}, seed=seed)

    mixed = make(3)
    epoch0, epoch1 = _epoch_items(mixed, 0), _epoch_items(mixed, 1)
    assert epoch0 != epoch1
    assert _epoch_items(make(3), 0) == epoch0 and _epoch_items(make(4), 0) != epoch0
    # A pure function of (seed, epoch, index): no state from earlier epochs, survives pickling (workers).
    fresh = make(3)
    assert _epoch_items(fresh, 1) == epoch1
    clone = pickle.loads(pickle.dumps(mixed))
    assert _epoch_items(clone, 0) == epoch0 and [mixed.locate(i, epoch=1) for i in range(32)] == \
        [clone.locate(i, epoch=1) for i in range(32)]


def test_dataloader_workers_see_the_epoch_set_before_the_iterator_is_made():
    mixed = MixedDataset({"a": Tagged("a", 6), "b": Tagged("b", 6)}, {"a": 1, "b": 1}, seed=2)
    sampler = StepBatchSampler(len(mixed), 4, 1, 1, 0, seed=2, shuffle=False)
    loader = DataLoader(mixed, batch_sampler=sampler, num_workers=1, collate_fn=mixed.collater)
    for epoch in (0, 1):
        mixed.set_epoch(epoch)  # what the trainer's data side does next to sampler.set_position, before iter()
        assert [x for batch in loader for x in batch] == [mixed.__getitem__(i) for i in range(12)]
    assert _epoch_items(mixed, 0) != _epoch_items(mixed, 1)


@pytest.mark.parametrize("epoch", [0, 3])
def test_the_mixed_order_does_not_depend_on_the_world_size(epoch):
    mixed = MixedDataset({"a": Tagged("a", 40), "b": Tagged("b", 9)}, {"a": 1, "b": 2}, seed=11)
    mixed.set_epoch(epoch)

    def global_steps(micro, accum, world):
        ranks = []
        for rank in range(world):
            sampler = StepBatchSampler(len(mixed), micro, accum, world, rank, seed=11)
            sampler.set_position(epoch)
            ranks.append([mixed[i] for batch in sampler for i in batch])
        per_step = micro * accum
        return [sorted(x for r in ranks for x in r[s * per_step:(s + 1) * per_step])
                for s in range(len(ranks[0]) // per_step)]

    one = global_steps(micro=8, accum=1, world=1)
    assert global_steps(micro=2, accum=2, world=2) == one == global_steps(micro=1, accum=4, world=2)
    assert Counter(name for step in one for name, _ in step)["b"] > 0


def test_without_sample_ratio_the_trainer_keeps_concatenating():
    datasets = {"a": {"train": Tagged("a", 5)}, "b": {"train": Tagged("b", 5), "val": Tagged("bv", 2)}}
    assert mix_train_splits(datasets, {"a": {}, "b": {}}, ["train"], seed=0) is None
    # One training dataset: a ratio has nothing to weigh against.
    assert mix_train_splits({"a": datasets["a"]}, {"a": {"sample_ratio": 2.0}}, ["train"], seed=0) is None
    mixed = mix_train_splits(datasets, {"a": {"sample_ratio": 1}, "b": {"sample_ratio": 4}}, ["train"], seed=0)
    assert mixed.shares == {"a": 2, "b": 8} and mixed.collater is Tagged.collater
    with pytest.raises(ValueError, match=r"datasets\.b\.sample_ratio: missing"):
        mix_train_splits(datasets, {"a": {"sample_ratio": 1}, "b": {}}, ["train"], seed=0)


# ---- a real run: two dataset sections mixed by ratio, one process ---------------------------------

def test_two_mixed_datasets_train_on_one_process(tmp_path):
    spec = DemoShapesSpec(num_train=128, num_val=16, num_test=8)
    storage = ensure_demo_shapes(tmp_path / "demo_shapes", spec)
    demo_train = json.loads((storage / "annotations/train.json").read_text())
    captions = [{"image": r["image"], "caption": r["output"]} for r in demo_train if r["instruction"] == CAPTION_PROMPT]
    coco = _json(tmp_path / "captions.json", captions)

    out = tmp_path / "out"
    cfg = tiny_config(out, storage, stage=0, micro=8, max_epoch=1)
    cfg["datasets"]["demo_shapes"]["sample_ratio"] = 1
    cfg["datasets"]["captions"] = {
        "builder": "coco_caption", "sample_ratio": 3, "prompt": CAPTION_PROMPT,
        "build_info": {"annotations": {"train": {"storage": str(coco)}}, "images": {"storage": str(storage / "images")}},
        "vis_processor": {"train": {"name": "blip2_image_train", "image_size": 64}, "eval": {"image_size": 64}}}
    # Launched through an audit hook that logs every file opened under tmp_path: the config check and the
    # build must share what they parsed, so each annotation file is opened (and parsed) once.
    opened = tmp_path / "opened.log"
    cmd = [sys.executable, str(REPO / "tests" / "open_counter.py"), str(opened), str(tmp_path),
           *command(write_yaml(tmp_path / "mix.yaml", cfg), nproc=0)[1:]]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reads = Counter(opened.read_text().split())
    annotation_files = [coco] + [storage / "annotations" / f"{split}.json" for split in ("train", "val", "test")]
    assert {str(f): reads[str(f)] for f in annotation_files} == {str(f): 1 for f in annotation_files}

    total = 128 + len(captions)
    shares = apportion(total, {"demo_shapes": 1, "captions": 3})
    assert (f"mixing 2 datasets by sample_ratio, {total} samples per epoch: demo_shapes {shares['demo_shapes']} "
            f"({shares['demo_shapes'] / 128:.2f} x its 128 records), captions {shares['captions']}") in proc.stdout
    steps = [m for m in metrics(out) if "split" not in m]
    assert [m["step"] for m in steps] == list(range(1, total // 8 + 1))
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in steps)
    assert yaml.safe_load((out / "config.yaml").read_text())["datasets"]["captions"]["sample_ratio"] == 3
