"""lmms-eval on lavis_ds models: the demo's offline tasks through `lavis-ds eval` and through lmms-eval's own
`--model lavis_ds`, the same answers and scores from a run's checkpoint and from its export, and one `lavis_ds:` line
for each input lmms-eval cannot run.

One process imports lmms-eval (seconds) and reuses the demo model the inference tests train (`demo_export`); the
LLaVA paths, lmms-eval's `llava_hf` on the `--format hf` export included, are in test_export_hf_arch.py beside the
LLaVA run they reuse.
"""
from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from run_utils import REPO

TASKS = REPO / "projects" / "demo" / "lmms_eval"
LIMIT = 4  # documents per task: 4 captions and 4 x 6 colour choices per path


def eval_command(model: Path, out: Path, *more: str) -> list[str]:
    return ["eval", "--model", str(model), "--tasks", "demo_shapes_caption,demo_shapes_colour", "--include_path",
            str(TASKS), "--limit", str(LIMIT), "--batch_size", "4", "--output_path", str(out), "--log_samples", *more]


def written(out: Path) -> tuple[dict, dict[str, list]]:
    """``(results, {task: [(doc_id, filtered_resps)]})`` from lmms-eval's files under ``out``."""
    [results] = out.glob("*/*_results.json")
    samples = {}
    for path in sorted(out.glob("*/*_samples_*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        samples[lines[0]["task_name"] if "task_name" in lines[0] else path.stem.split("_samples_")[1]] = \
            sorted((line["doc_id"], line["filtered_resps"]) for line in lines)
    return json.loads(results.read_text())["results"], samples


@pytest.fixture(scope="module")
def offline(demo_export, tmp_path_factory):
    """The demo tasks' images are the demo model's test images; nothing reaches the network."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAVIS_DS_DEMO_DATA", str(demo_export.storage))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets_cache")))
        # lmms-eval's logger (loguru) keeps the sys.stderr of its import: imported inside a test's capsys, its later
        # messages would go to that test's closed stream and print loguru's own traceback into another test's
        import lmms_eval.evaluator  # noqa: F401
        yield demo_export


@pytest.fixture(scope="module")
def evaluated(offline, tmp_path_factory):
    """`lavis-ds eval` on the demo run (its newest checkpoint), and lmms-eval's own `--model lavis_ds` (the entry
    point's class, built from `--model_args`) on the run's export."""
    from lavis_ds.cli import main
    from lmms_eval import evaluator
    from lmms_eval.models import MODEL_REGISTRY_V2
    from lmms_eval.tasks import TaskManager

    from lavis_ds.apps.eval_model import manifest

    out = tmp_path_factory.mktemp("eval_run")
    assert main(eval_command(offline.folder.parent / "run", out)) == 0
    MODEL_REGISTRY_V2.register_manifest(manifest())  # what the installed entry point does (checked below)
    theirs = evaluator.simple_evaluate(model="lavis_ds", model_args=f"pretrained={offline.folder}", batch_size=4,
                                       tasks=["demo_shapes_caption", "demo_shapes_colour"], limit=LIMIT,
                                       task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), log_samples=True)
    samples = {task: sorted((s["doc_id"], s["filtered_resps"]) for s in lines)
               for task, lines in theirs["samples"].items()}
    return written(out), (json.loads(json.dumps(theirs["results"], default=float)), samples)


def test_the_checkpoint_and_its_export_give_the_same_answers_and_scores(evaluated):
    (run_results, run_samples), (export_results, export_samples) = evaluated
    assert run_samples.keys() == {"demo_shapes_caption", "demo_shapes_colour"}
    assert [len(run_samples[task]) for task in sorted(run_samples)] == [LIMIT, LIMIT]
    # lmms-eval's samples file writes a generation's one answer, and every log-likelihood result as text
    assert run_samples == {task: [(doc, _as_written(resps)) for doc, resps in lines]
                           for task, lines in export_samples.items()}
    for task, metric in (("demo_shapes_caption", "exact_match,none"), ("demo_shapes_colour", "acc,none")):
        assert run_results[task][metric] == export_results[task][metric]
    # Real answers and real log-likelihoods: the trained demo model captions, and scores six choices per document
    captions = [resps[0] for _, resps in run_samples["demo_shapes_caption"]]
    assert all(isinstance(text, str) for text in captions) and any(text.strip() for text in captions)
    choices = [resps for _, resps in run_samples["demo_shapes_colour"]]
    assert all(len(doc) == 6 and all(float(loss) > 0 for loss, _ in doc) for doc in choices)


def _as_written(value):
    """A result as lmms-eval's samples file writes it: a generation's one answer as it is, the rest as str()."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, (list, tuple)):
        return [_as_written(v) if isinstance(v, (list, tuple)) else str(v) for v in value]
    return value


def test_the_demo_task_documents_are_the_demo_s_test_split(offline):
    """The task's JSON holds the first 16 test records of the demo data generator (seed 0, 64 px): the images the
    demo trains beside and the test split's answers."""
    records = json.loads((offline.storage / "annotations" / "test.json").read_text())
    documents = json.loads((TASKS / "demo_shapes_test.json").read_text())
    assert len(documents) == 16 <= len(records)
    assert [(d["image"], d["answer"], f"{d['colour']} {d['shape']}") for d in documents] == \
        [(r["image"], r["output"], " ".join(r["output"].split()[1:])) for r in records[:16]]


def test_lmms_eval_finds_the_model_by_the_entry_point_pyproject_declares():
    import importlib

    from lmms_eval.models.registry_v2 import ModelRegistryV2

    from lavis_ds.apps.eval_model import PretrainedLavisDsLmms

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["lmms_eval.models"]
    module, attribute = declared["lavis_ds"].split(":")
    registry = ModelRegistryV2()
    for manifest in registry._coerce_payload_to_manifests(getattr(importlib.import_module(module), attribute)):
        registry.register_manifest(manifest)
    assert registry.get_model_class("lavis_ds") is PretrainedLavisDsLmms
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"lmms-eval==0.7.3", "decord", "filelock<4"} <= set(extras["eval"]) & set(extras["dev"])


# ----------------------------------------------------------------------------- one line per bad input
def _task_without_its_file(folder: Path) -> Path:
    """docs/evaluation.md's recipe for a benchmark on local files: a YAML that includes a task and points its
    data_files elsewhere, here at a file that is not there."""
    (folder / "demo_shapes_elsewhere.yaml").write_text(
        f"include: {TASKS / 'demo_shapes_caption.yaml'}\ntask: demo_shapes_elsewhere\ndataset_path: json\n"
        "dataset_kwargs:\n  data_files:\n    test: copies/demo_shapes_test.json\n")
    return folder


def _tiny_max_txt_len(export: Path, folder: Path) -> Path:
    """The demo export with model.max_txt_len cutting the answer after the prompt (a setting that cannot score)."""
    import shutil

    from omegaconf import OmegaConf

    copy = shutil.copytree(export, folder / "short")
    cfg = OmegaConf.load(copy / "config.yaml")
    # The prompt up to the assistant's header is 50 tokens: 51 keeps the answer's first token and cuts its end (a
    # log-likelihood of part of the answer, which must not pass for the answer's)
    cfg.model.max_txt_len = 51
    OmegaConf.save(cfg, copy / "config.yaml")
    return copy


@pytest.mark.parametrize("case, message", [
    ("unknown task", r"unknown lmms-eval task 'demo_shapes_captoin' \(closest: demo_shapes_caption"),
    ("dataset not on disk", r"task demo_shapes_elsewhere \(.*demo_shapes_elsewhere\.yaml\): dataset file "
                            r"copies/demo_shapes_test\.json is not on disk"),
    ("hub dataset offline", r"task demo_shapes_hub \(.*hub\.yaml\): dataset lavis-ds-tests/no-such-dataset "
                            r"\(dataset_path, a Hugging Face hub dataset\) is not in the datasets cache .*, and "
                            r"HF_DATASETS_OFFLINE=1 forbids downloading it"),
    ("lmms-eval missing", r"lmms-eval is not installed here .*install it with: pip install -e \"\.\[eval\]\""),
    ("answer cut by max_txt_len", r"task demo_shapes_colour \(test doc 0\): the model's max_txt_len=51 cuts the "
                                  r"continuation, so its log-likelihood cannot be computed"),
])
def test_bad_input_is_one_lavis_ds_line_and_exit_code_2(offline, case, message, tmp_path, monkeypatch, capsys):
    from lavis_ds.cli import main

    model, tasks = offline.folder, "demo_shapes_caption"
    more = ["--include_path", str(TASKS)]
    if case == "unknown task":
        tasks = "demo_shapes_captoin"
    elif case == "dataset not on disk":
        tasks, more = "demo_shapes_elsewhere", ["--include_path", str(_task_without_its_file(tmp_path))]
    elif case == "hub dataset offline":  # HF_DATASETS_OFFLINE (the module's fixture): refused before lmms-eval runs
        (tmp_path / "hub.yaml").write_text(f"include: {TASKS / 'demo_shapes_caption.yaml'}\ntask: demo_shapes_hub\n"
                                           "dataset_path: lavis-ds-tests/no-such-dataset\ndataset_kwargs: {}\n")
        tasks, more = "demo_shapes_hub", ["--include_path", str(tmp_path)]
    elif case == "lmms-eval missing":
        monkeypatch.setitem(sys.modules, "lmms_eval", None)
    else:
        model, tasks = _tiny_max_txt_len(offline.folder, tmp_path), "demo_shapes_colour"
    assert main(["eval", "--model", str(model), "--tasks", tasks, "--limit", "1", *more]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("lavis_ds:")]) == 1 and "Traceback" not in "\n".join(err)
    line = next(line for line in err if line.startswith("lavis_ds:"))
    import re

    assert re.search(message, line), line


def test_a_model_that_gives_no_log_likelihoods_is_refused_for_a_multiple_choice_task(offline):
    """A registered model that is a vision tower alone (eva_vit_g) has no LLM to score an answer with."""
    from lmms_eval import evaluator
    from lmms_eval.tasks import TaskManager

    from lavis_ds.common import registry as reg
    from lavis_ds.common.errors import InputError
    from lavis_ds.datasets.processor_sections import build_processor
    from lavis_ds.runners.lmms_eval.model import LavisDsLmms

    tower_cls = reg.models.get("eva_vit_g")
    tower = tower_cls.from_config(tower_cls.default_config("tiny"))
    lm = LavisDsLmms(tower, build_processor({"name": "blip2_image_eval", "image_size": 64}))
    with pytest.raises(InputError, match=r"task 'demo_shapes_colour' asks for log-likelihoods \(a multiple-choice "
                                         r"task\); EvaViT cannot give log-likelihoods \(it has no _inputs, "
                                         r"llm_model, llm"):
        evaluator.simple_evaluate(model=lm, tasks=["demo_shapes_colour"], limit=1,
                                  task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))


# ----------------------------------------------------------------------------- requests as batches
def test_a_request_s_images_and_video_make_the_batch_their_training_records_make(tmp_path):
    """Several images in one request, LLaVA's `<image>` marking each, and a video request: the instruction, the
    pixels and the frames a training record of the same content gives (no lmms-eval needed: requests are values)."""
    from PIL import Image

    from lavis_ds.datasets.processor_sections import build_processor
    from lavis_ds.datasets.instruction import InstructionDataset
    from lavis_ds.runners.lmms_eval.requests import Request, batch_of
    from test_images_per_sample import write_video

    images = [Image.new("RGB", (40, 30), colour) for colour in ((200, 30, 30), (30, 200, 30))]
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
    write_video(tmp_path / "clip.mp4", frames=10)
    records = [{"image": ["0.png", "1.png"], "instruction": "<Img><ImageHere></Img> <Img><ImageHere></Img> "
                "Which image is green?", "output": "the second"},
               {"video": "clip.mp4", "instruction": "<Img><ImageHere></Img> Describe the video.", "output": "grey"}]
    (tmp_path / "records.json").write_text(json.dumps(records))
    processor = build_processor({"name": "blip2_image_eval", "image_size": 32})
    dataset = InstructionDataset([tmp_path / "records.json"], tmp_path, processor, max_frames=4)
    requests = [Request("<image>\n<image>\nWhich image is green?", images, settings={}),
                Request("Describe the video.", [str(tmp_path / "clip.mp4")], settings={})]
    ours = batch_of(requests, processor, None, max_frames=4)
    theirs = InstructionDataset.collater([dataset[0], dataset[1]])
    assert ours["instruction"] == theirs["instruction"]
    assert ours["num_images"] == theirs["num_images"] == [2, 4]
    assert torch.equal(ours["image"], theirs["image"])
