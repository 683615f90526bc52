"""The packed record store and the parse-once hand-over between a config check and a build, in-process."""
from __future__ import annotations

import functools

import gc
import json
import os
import pickle
import pickletools
import types
from pathlib import Path

import pytest
from PIL import Image

from lavis_ds.datasets import CocoCaptionBuilder, InstructionDataset, LlavaConversationBuilder, RecordLoader
from lavis_ds.datasets.coco_caption import parse_coco_caption_file
from lavis_ds.datasets.instruction import MissingImageError, parse_instruction_file
from lavis_ds.datasets.llava import parse_llava_file
from lavis_ds.datasets.loading import ParsedFiles
from lavis_ds.datasets.record_store import RecordStore, pack
from lavis_ds.datasets.records import BadRecord, InstructionRecord
from lavis_ds.datasets.vqa import parse_vqa_file
from lavis_ds.processors import Blip2ImageEvalProcessor

EVAL_16 = {"train": {"name": "blip2_image_eval", "image_size": 16}, "eval": {"name": "blip2_image_eval", "image_size": 16}}


def _json(path: Path, content) -> Path:
    path.write_text(json.dumps(content, ensure_ascii=False))
    return path


def _llava(n: int, turns: int = 2) -> list[dict]:
    return [{"id": f"r{i}" if i % 2 else i, "image": f"coco/{i % 7}.png", "conversations": [
        {"from": "human" if t % 2 == 0 else "gpt", "value": ("<image>\n" if t == 0 else "") + f"turn {t} of {i}: ünï ✓"}
        for t in range(2 * turns)]} for i in range(n)]


def _parsed(parse, raw, source: Path) -> list[InstructionRecord]:
    return [r for r in parse(raw, source) if not isinstance(r, BadRecord)]


# Every format's records, with every field the store keeps: int and str ids, list names, references, several turns.
FORMATS = {
    "llava": (parse_llava_file, _llava(9, turns=3)),
    "instruction": (parse_instruction_file, [{"image": "a.png", "instruction": ["<Img><ImageHere></Img> q", "q2"],
                                              "output": ["a", "a2"]}, {"image": "b.png", "instruction": "i", "output": "o"}]),
    "coco_official_grouped": (lambda raw, src: parse_coco_caption_file(raw, src, group_references=True),
                              {"images": [{"id": 7, "file_name": "x.png"}, {"id": "y", "file_name": "y.png"}],
                               "annotations": [{"id": 1, "image_id": 7, "caption": "one"},
                                               {"id": 2, "image_id": "y", "caption": "two"},
                                               {"id": 3, "image_id": 7, "caption": "three"}]}),
    "vqa": (parse_vqa_file, [{"question_id": 262148000, "question": "Where?", "answer": ["down", "down", "left"],
                              "image": "val2014/a.jpg"}]),
}


@pytest.mark.parametrize("name", FORMATS)
def test_a_store_gives_back_exactly_the_parsed_records(tmp_path, name):
    parse, raw = FORMATS[name]
    path = _json(tmp_path / f"{name}.json", raw)
    expected = _parsed(parse, raw, path)
    records, bad = RecordLoader(parse, check_images=False).read(path, None)
    assert isinstance(records, RecordStore) and bad == []
    assert list(records) == expected and len(records) == len(expected)
    assert [records[i] for i in range(-len(expected), 0)] == expected and records[1:3] == expected[1:3]
    with pytest.raises(IndexError, match=rf"record {len(expected)} out of range \({len(expected)} records\)"):
        records[len(expected)]


def test_stores_of_several_files_concatenate_in_order_without_copying(tmp_path):
    first, second = _json(tmp_path / "a.json", _llava(5)), _json(tmp_path / "b.json", _llava(3))
    loader = RecordLoader(parse_llava_file, check_images=False)
    joined = loader.load([first, second], None).records
    assert list(joined) == _parsed(parse_llava_file, _llava(5), first) + _parsed(parse_llava_file, _llava(3), second)
    assert joined[6].where() == f"{second}: record 1 (id 'r1', image 'coco/1.png')"
    parts = [loader.read(p, None)[0]._parts[0] for p in (first, second)]
    assert all(a is b for a, b in zip(joined._parts, parts))  # the files' buffers themselves


def test_bad_records_kept_for_the_log_do_not_keep_the_parsed_file_alive(tmp_path):
    """A caught exception's traceback holds the parser's frames, and with them the whole parsed JSON (GBs for
    mix665k, whose 40k text-only records are kept to be counted): the loader keeps them without."""
    text_only = {"id": "t", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    path = _json(tmp_path / "mix.json", _llava(3) + [text_only])
    parse = functools.partial(parse_llava_file, skip_text_only=True)  # as the builder binds `skip_text_only: true`
    loaded = RecordLoader(parse, skip={BadRecord.TEXT_ONLY}, check_images=False).load([path], None)
    assert len(loaded.records) == 3 and [b.kind for b in loaded.skipped] == [BadRecord.TEXT_ONLY]
    assert loaded.skipped[0].__traceback__ is None and "mix.json: record 3 (id 't')" in str(loaded.skipped[0])


def _pickle_opcodes(obj) -> int:
    return sum(1 for _ in pickletools.genops(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)))


def _reachable_objects(obj) -> int:
    """Python objects reachable from ``obj`` (what a forked worker could touch, and a pickle must write), short of
    classes, modules and functions: code is shared by every dataset, and a function's globals lead to every module
    (whose state, such as the warnings registry, changes while they are walked)."""
    seen, todo = set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) not in seen and not isinstance(o, (type, types.ModuleType, types.FunctionType,
                                                     types.BuiltinFunctionType)):
            seen.add(id(o))
            todo.extend(gc.get_referents(o))
    return len(seen)


def test_a_store_holds_and_pickles_no_object_per_record(tmp_path):
    """A DataLoader worker gets the dataset by fork (sharing its memory) or by pickle (spawn): either way, the
    records are two arrays per file, never one Python object per record whose refcount a worker would write."""
    small, large = (pack(_parsed(parse_llava_file, _llava(n), tmp_path / "x.json")) for n in (10, 5000))
    assert len(large) == 5000 and large.nbytes > 100 * small.nbytes
    # (Within a few opcodes: a longer byte string may take another FRAME; one object per record would add 5000.)
    assert _pickle_opcodes(large) <= _pickle_opcodes(small) + 5
    assert _reachable_objects(large) == _reachable_objects(small)
    copy = pickle.loads(pickle.dumps(large))
    assert list(copy) == list(large)

    # The same through the dataset a DataLoader pickles for its workers.
    root = tmp_path / "images"
    for i in range(7):
        (root / "coco").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(root / f"coco/{i}.png")
    datasets = [InstructionDataset(_json(tmp_path / f"{n}.json", _llava(n)), root, Blip2ImageEvalProcessor(image_size=16),
                                   loader=RecordLoader(parse_llava_file)) for n in (10, 2000)]
    assert _pickle_opcodes(datasets[1]) <= _pickle_opcodes(datasets[0]) + 5
    assert _reachable_objects(datasets[0]) == _reachable_objects(datasets[1])


def test_a_missing_image_at_access_still_names_the_file_and_the_record(tmp_path):
    root = tmp_path / "images"
    (root / "coco").mkdir(parents=True)
    for i in range(7):
        Image.new("RGB", (8, 8)).save(root / f"coco/{i}.png")
    path = _json(tmp_path / "llava.json", _llava(9))
    dataset = InstructionDataset(path, root, Blip2ImageEvalProcessor(image_size=16), loader=RecordLoader(parse_llava_file))
    os.remove(root / "coco/3.png")
    with pytest.raises(MissingImageError, match=r"llava\.json: record 3 \(id 'r3', image 'coco/3\.png'\): image file "
                                                 r".*coco/3\.png not found"):
        dataset[3]


# ---- parse once: what a config check parsed is what the build uses ----------------------------------------

def _section(annotation: Path, images: Path, **options) -> dict:
    return {"build_info": {"annotations": {"train": {"storage": str(annotation)}, "val": {"storage": str(annotation)}},
                           "images": {"storage": str(images)}}, "vis_processor": EVAL_16, **options}


def test_a_build_uses_the_files_its_config_check_parsed_and_rereads_a_changed_file(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    path = _json(tmp_path / "coco.json", [{"image": "a.png", "caption": ["one", "two"]}])
    parsed = ParsedFiles()
    # Two builders, as load_config and build_datasets make them, with one ParsedFiles handed between them.
    assert CocoCaptionBuilder(_section(path, tmp_path), parsed_files=parsed).check() == []
    checked = {key: store for key, (store, _) in parsed._files.items()}
    splits = CocoCaptionBuilder(_section(path, tmp_path), parsed_files=parsed).build()
    assert {key: store for key, (store, _) in parsed._files.items()} == checked
    # Training reads a caption per sample, evaluation all captions on one: two readings of the one file.
    assert len(checked) == 2 and len(splits["train"]) == 2 and len(splits["val"]) == 1
    assert {id(splits[s].records._parts[0]) for s in splits} == {id(s._parts[0]) for s in checked.values()}

    # Another builder with other options reads the file its own way; a file changed on disk is read again.
    assert LlavaConversationBuilder(_section(path, tmp_path), parsed_files=parsed).check() != []
    _json(path, [{"image": "a.png", "caption": ["one", "two", "three"]}])
    assert len(CocoCaptionBuilder(_section(path, tmp_path), parsed_files=parsed).build()["train"]) == 3
