"""Batch inference: `python -m lavis_ds.apps.generate --data ... --out preds.jsonl` on a trained, exported model.

The model is conftest's ``demo_export`` (the tiny demo trained once per session). The
reference answers come from the library function a user would call on one image at a
time (``lavis_ds.apps.generation.generate``): the file mode must give the same text, in input
order, on one process or two, and after an interruption.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from lavis_ds.datasets.records import IMAGE_PLACEHOLDER
from lavis_ds.apps.export import load_exported
from lavis_ds.apps.generate import main
from lavis_ds.apps.predictions_file import share_path
from lavis_ds.apps.generation import eval_processors, generate
from run_utils import REPO, env, free_port, run_forked

MAX_NEW_TOKENS = 8

# A real Karpathy-split record (COCO val2014 image 391895, its five reference captions as the
# example element in neuraltalk2's prepro.py quotes them, stray spaces included); LAVIS's
# coco_karpathy_test.json has the same layout under the keys image/caption.
KARPATHY_391895 = {
    "image": "val2014/COCO_val2014_000000391895.jpg",
    "caption": ["A man with a red helmet on a small moped on a dirt road. ",
                "Man riding a motor bike on a dirt road on the countryside.",
                "A man riding on the back of a motorcycle.",
                "A dirt path with a young person on a motor bike rests to the foreground of a verdant area with a "
                "bridge and a background of cloud-wreathed mountains. ",
                "A man in a red shirt and a red hat is on a motorcycle on a hill side."],
    "image_id": "391895",
}


@pytest.fixture(scope="module")
def model(demo_export):
    return load_exported(demo_export.folder)


@pytest.fixture(scope="module")
def answer_one(model, demo_export):
    """``answer_one(image path, turns, earlier answers)`` -> the model's answer, one sample per call."""
    image_processor, _ = eval_processors(demo_export.folder)

    def answer(path: Path, turns: list[str], answers: list[str] = ()) -> str:
        with Image.open(path) as image:
            tensor = image_processor(image.convert("RGB"))[None]
        return generate(model, tensor, [turns], [list(answers)], max_new_tokens=MAX_NEW_TOKENS)[0]

    return answer


@pytest.fixture(scope="module")
def full_run(demo_export, tmp_path_factory):
    """The demo's test split through the command line, one process: (its output file, the lines).

    ``python -m lavis_ds.apps.generate``'s main() in a process forked from the suite's server (tests/forked.py); the
    command itself is launched, under torchrun, by test_torchrun_shards_merge_into_the_same_file."""
    out = tmp_path_factory.mktemp("full") / "preds.jsonl"
    proc = run_forked("lavis_ds.apps.generate:main", [
        "--model", str(demo_export.folder), "--data", str(demo_export.test_annotations),
        "--images", str(demo_export.storage / "images"), "--out", str(out), "--batch-size", "5",
        "--max-new-tokens", str(MAX_NEW_TOKENS)], out.parent / "generate.logs", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "16 sample(s); 0 already" in proc.stderr and "wrote 16 answer(s)" in proc.stderr
    return out, [json.loads(line) for line in out.read_text().splitlines()]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*args: str) -> int:
    return main([*args, "--max-new-tokens", str(MAX_NEW_TOKENS)])


def test_file_mode_answers_every_record_in_input_order_as_one_sample_calls_do(full_run, demo_export, answer_one):
    _, lines = full_run
    records = json.loads(demo_export.test_annotations.read_text())
    assert [line["index"] for line in lines] == list(range(len(records)))
    for line, record in zip(lines, records):
        assert line == {"index": line["index"], "id": None, "image": record["image"], "prompt": record["instruction"],
                        "references": [record["output"]], "generated": line["generated"]}
        # Batches of 5 (the last one short) give what one sample at a time gives.
        assert line["generated"] == answer_one(demo_export.storage / "images" / record["image"],
                                               [record["instruction"]])
    # The model answers from the image: not one text for all 16 shapes.
    assert len({line["generated"] for line in lines}) > 1


def test_single_prompt_mode_still_prints_the_answer(full_run, demo_export, capsys):
    first = full_run[1][0]
    code = main(["--model", str(demo_export.folder), "--image", str(demo_export.image("test", 0)),
                 "--prompt", "Describe the image in a few words.", "--max-new-tokens", str(MAX_NEW_TOKENS)])
    assert code == 0
    assert capsys.readouterr().out.strip() == first["generated"]


def test_the_runs_own_annotation_file_finds_its_images_without_images(full_run, demo_export, tmp_path, capsys):
    """The demo's annotation files and images are in sibling folders: the export's config says where the run read
    the images of the file it is given."""
    out = tmp_path / "preds.jsonl"
    assert _run("--model", str(demo_export.folder), "--data", str(demo_export.test_annotations), "--out", str(out),
                "--batch-size", "5") == 0
    assert (f"images from {demo_export.storage / 'images'} (datasets.demo_shapes.build_info.storage of the run, "
            f"whose annotations include {demo_export.test_annotations})") in capsys.readouterr().err
    assert out.read_text() == full_run[0].read_text()


def test_torchrun_shards_merge_into_the_same_file(full_run, demo_export, tmp_path):
    out = tmp_path / "preds.jsonl"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", "-m", "lavis_ds.apps.generate",
                           "--model", str(demo_export.folder), "--data", str(demo_export.test_annotations),
                           "--images", str(demo_export.storage / "images"), "--out", str(out),
                           "--batch-size", "3", "--max-new-tokens", str(MAX_NEW_TOKENS)],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "16 to answer on 2 process(es)" in proc.stderr
    assert out.read_text() == full_run[0].read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.jsonl"]  # the shares were merged and removed


def test_an_interrupted_file_is_resumed_and_a_torn_last_line_redone(full_run, demo_export, tmp_path, capsys):
    full_text = full_run[0].read_text()
    lines = full_text.splitlines(keepends=True)
    out = tmp_path / "preds.jsonl"
    # Killed while writing line 6: five complete lines and half of the sixth.
    out.write_text("".join(lines[:5]) + lines[5][:40])
    args = ["--model", str(demo_export.folder), "--data", str(demo_export.test_annotations),
            "--images", str(demo_export.storage / "images"), "--out", str(out), "--batch-size", "4", "--num-workers", "1"]
    assert _run(*args) == 0
    assert "5 already in" in capsys.readouterr().err
    assert out.read_text() == full_text

    # A two-process run stopped part-way left shares (rank 1's with a torn line); one process finishes the job.
    out.write_text("")
    share_path(out, 0).write_text("".join(lines[0:4:2]))
    share_path(out, 1).write_text("".join(lines[1:6:2]) + lines[7][:10])
    assert _run(*args) == 0
    assert "5 already in" in capsys.readouterr().err
    assert out.read_text() == full_text
    assert not share_path(out, 0).exists() and not share_path(out, 1).exists()

    # Nothing left to do: nothing is generated again and the file stays as it is.
    assert _run(*args) == 0
    assert "16 already in" in capsys.readouterr().err and out.read_text() == full_text


def _coco_images(root: Path, demo_export) -> None:
    """Demo shapes saved under COCO names (JPEG, as COCO's are)."""
    for i, name in enumerate(["val2014/COCO_val2014_000000391895.jpg", "val2014/COCO_val2014_000000522418.jpg"]):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        with Image.open(demo_export.image("test", i)) as image:
            image.convert("RGB").save(root / name, quality=95)


def test_coco_caption_files_keep_every_reference_of_an_image_together(demo_export, tmp_path, capsys, answer_one):
    _coco_images(tmp_path, demo_export)
    karpathy = tmp_path / "coco_karpathy_test.json"
    karpathy.write_text(json.dumps([KARPATHY_391895, {"image": "val2014/COCO_val2014_000000522418.jpg",
                                                      "caption": "A woman cutting a cake.", "image_id": "522418"}]))
    out = tmp_path / "karpathy.jsonl"
    assert _run("--model", str(demo_export.folder), "--data", str(karpathy), "--out", str(out),
                "--prompt", "Describe the image in a few words.") == 0
    assert "(coco_caption): 2 sample(s)" in capsys.readouterr().err  # detected; images under the file's folder
    first, second = _lines(out)
    assert first["id"] == "391895" and first["image"] == KARPATHY_391895["image"]
    assert first["references"] == KARPATHY_391895["caption"]  # all five, as written
    assert second["references"] == ["A woman cutting a cake."]
    assert first["prompt"] == f"{IMAGE_PLACEHOLDER} Describe the image in a few words."
    assert first["generated"] == answer_one(tmp_path / KARPATHY_391895["image"], [first["prompt"]])

    # The official layout: captions are annotations of an image; they are grouped by image too.
    official = tmp_path / "captions_val2014.json"
    official.write_text(json.dumps({
        "images": [{"id": 391895, "file_name": "COCO_val2014_000000391895.jpg"},
                   {"id": 522418, "file_name": "COCO_val2014_000000522418.jpg"}],
        "annotations": [{"id": 770337, "image_id": 391895, "caption": KARPATHY_391895["caption"][0]},
                        {"id": 681330, "image_id": 522418, "caption": "A woman cutting a cake."},
                        {"id": 771687, "image_id": 391895, "caption": KARPATHY_391895["caption"][1]}]}))
    out = tmp_path / "official.jsonl"
    assert _run("--model", str(demo_export.folder), "--data", str(official), "--format", "coco_caption",
                "--images", str(tmp_path / "val2014"), "--out", str(out)) == 0
    lines = _lines(out)
    assert [line["image"] for line in lines] == ["COCO_val2014_000000391895.jpg", "COCO_val2014_000000522418.jpg"]
    assert lines[0]["references"] == KARPATHY_391895["caption"][:2]


def test_llava_conversations_answer_the_last_turn_after_the_earlier_ones(demo_export, tmp_path, answer_one):
    images = demo_export.storage / "images"
    data = tmp_path / "llava.json"
    data.write_text(json.dumps([
        {"id": "000000033471", "image": "test_00002.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is the shape?"}, {"from": "gpt", "value": "purple"},
            {"from": "human", "value": "What shape is it?"}, {"from": "gpt", "value": "circle"}]},
        {"id": "000000052846", "image": "test_00003.png", "conversations": [
            {"from": "human", "value": "Describe the image in a few words.\n<image>"},
            {"from": "gpt", "value": "an orange circle"}]}]))
    out = tmp_path / "preds.jsonl"
    assert _run("--model", str(demo_export.folder), "--data", str(data), "--images", str(images),
                "--out", str(out)) == 0
    multi, single = _lines(out)
    assert multi["id"] == "000000033471" and multi["prompt"] == "What shape is it?"
    assert multi["history"] == [[f"{IMAGE_PLACEHOLDER} What colour is the shape?", "purple"]]
    assert multi["references"] == ["circle"]
    assert multi["generated"] == answer_one(images / "test_00002.png",
                                            [f"{IMAGE_PLACEHOLDER} What colour is the shape?", "What shape is it?"],
                                            ["purple"])
    assert single["prompt"] == f"{IMAGE_PLACEHOLDER} Describe the image in a few words." and "history" not in single


def test_chat_records_are_answered_with_their_own_system_turns(demo_export, model, tmp_path):
    """ms-swift's quoted records (tests/fixtures/chat_messages): text-only, each with its own system turn."""
    import torch

    data = tmp_path / "swift.jsonl"
    shutil.copy(Path(__file__).parent / "fixtures" / "chat_messages" / "swift_sft_en.jsonl", data)
    out = tmp_path / "preds.jsonl"
    assert _run("--model", str(demo_export.folder), "--data", str(data), "--images", str(tmp_path),
                "--out", str(out)) == 0
    weather, math = _lines(out)
    assert weather["system"] == "You are a useful and harmless assistant"
    assert math["system"] == "You are a useful and harmless math calculator"
    assert math["prompt"] == "What about adding 1?" and math["history"] == [["What is 1 + 1?", "It equals 2"]]
    expected = generate(model, torch.zeros((0, 3, 1, 1)), [["What is 1 + 1?", "What about adding 1?"]],
                        [["It equals 2"]], num_images=[0], systems=[math["system"]], max_new_tokens=MAX_NEW_TOKENS)
    assert math["generated"] == expected[0]


# ----------------------------------------------------------------------------- bad input
def _error(capsys, *args: str) -> str:
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_input_gets_a_clear_error(demo_export, tmp_path, capsys):
    model, data = str(demo_export.folder), str(demo_export.test_annotations)
    images = str(demo_export.storage / "images")
    out = str(tmp_path / "preds.jsonl")

    not_export = tmp_path / "not_an_export"
    not_export.mkdir()
    assert "not an export folder: config.yaml and model.safetensors missing" in _error(
        capsys, "--model", str(not_export), "--data", data, "--images", images, "--out", out)
    assert "image file(s) not found: nope.png" in _error(capsys, "--model", model, "--image", "nope.png",
                                                         "--prompt", "What?")
    assert "invalid choice: 'nonsense'" in _error(capsys, "--model", model, "--data", data, "--format", "nonsense",
                                                  "--out", out)

    missing_image = tmp_path / "missing_image.json"
    missing_image.write_text(json.dumps([{"image": "test_00000.png", "instruction": "Q?", "output": "A"},
                                         {"image": "gone.png", "instruction": "Q?", "output": "A"}]))
    err = _error(capsys, "--model", model, "--data", str(missing_image), "--images", images, "--out", out)
    assert f"{missing_image}: record 1 (image 'gone.png'): image file {images}/gone.png not found" in err
    assert "pass --skip-bad-records to leave such records out" in err
    assert _run("--model", model, "--data", str(missing_image), "--images", images, "--out", out,
                "--skip-bad-records") == 0
    assert [line["image"] for line in _lines(Path(out))] == ["test_00000.png"]

    # An image that exists but does not decode is found when its batch is loaded: the run stops there
    # with the file and the record, keeps what it wrote, and the same command continues once it is fixed.
    broken_root = tmp_path / "images"
    shutil.copytree(images, broken_root)
    (broken_root / "test_00006.png").write_bytes(b"not a png")
    broken_out = tmp_path / "broken.jsonl"
    args = ["--model", model, "--data", data, "--images", str(broken_root), "--out", str(broken_out),
            "--batch-size", "3", "--num-workers", "1"]
    err = _error(capsys, *args, "--max-new-tokens", str(MAX_NEW_TOKENS))
    assert f"record 6 (image 'test_00006.png'): cannot read image file {broken_root}/test_00006.png" in err
    assert "the answers so far are kept" in err
    assert [line["index"] for line in _lines(broken_out)] == list(range(6))
    shutil.copy(Path(images) / "test_00006.png", broken_root / "test_00006.png")
    assert _run(*args) == 0
    assert "6 already in" in capsys.readouterr().err
    assert [line["index"] for line in _lines(broken_out)] == list(range(16))

    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps([{"img": "a.png", "question": "Q?"}]))
    assert "cannot tell its annotation format (first record has keys ['img', 'question'])" in _error(
        capsys, "--model", model, "--data", str(unknown), "--images", images, "--out", out)

    # A predictions file of another annotation file is not "resumed" into a mix of both.
    assert "holds a line for another annotation file" in _error(
        capsys, "--model", model, "--data", data, "--images", images, "--out", out)
    assert "--prompt with --data sets the caption instruction of coco_caption files" in _error(
        capsys, "--model", model, "--data", data, "--images", images, "--out", out, "--prompt", "Hi")
