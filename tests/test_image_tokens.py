"""Tokens per image as one count (the prompt's placeholders and the spliced features follow the model's
``tokens_for_image``), flat features, and truncation that never cuts an image's placeholders."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from lavis_ds.common.errors import LavisDsError
from lavis_ds.datasets.lengths import counted_by, fit_token_estimate
from lavis_ds.models import Blip2Qwen
from lavis_ds.models.image_tokens import image_sizes, select_images
from lavis_ds.models.prompt import ImageSpanCut
from lavis_ds.objectives.sft import NextTokenSft

LONG = "Describe every object you can see, its colour, its size and where it stands. " * 3


@pytest.fixture(scope="module")
def model(tiny_tokenizer_dir) -> Blip2Qwen:
    cfg = {**Blip2Qwen.default_config("tiny"), "tokenizer": str(tiny_tokenizer_dir)}
    torch.manual_seed(0)
    return Blip2Qwen.from_config(cfg).eval()


def _batch() -> dict:
    """Three samples: one image, text only, one image after a long first turn (the one a short max_txt_len cuts)."""
    return {"image": torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)), "num_images": [1, 0, 1],
            "instruction": [["<Img><ImageHere></Img> What is it?"], ["Say hello."], [LONG, "<ImageHere> And this?"]],
            "output": [["A red circle."], ["Hello."], ["Many things.", "A blue square."]],
            "index": torch.tensor([4, 7, 9])}


def _short(model: Blip2Qwen, batch: dict) -> int:
    """A max_txt_len that keeps samples 0 and 1 whole and falls before sample 2's image."""
    lengths = model.prepare_batch(dict(batch))["attention_mask"].sum(1).tolist()
    first_image = model.prepare_batch(dict(batch))["input_ids"][2].tolist().index(model.llm.prompt.image_token_id)
    assert max(lengths[:2]) < first_image
    return first_image


def test_the_prompt_reserves_what_the_models_count_says_and_the_batch_keeps_it(model):
    batch = model.prepare_batch(_batch())
    assert image_sizes(_batch()) == [(64, 64), (64, 64)]
    layout = model.image_path.layout
    assert batch["image_tokens"] == layout.counts(_batch()) == [layout.tokens_per_image] * 2
    placeholders = (batch["input_ids"] == model.llm.prompt.image_token_id).sum(1).tolist()
    assert placeholders == [layout.tokens_per_image, 0, layout.tokens_per_image]
    features = model.image_features(batch)
    hidden = model.llm.config.hidden_size
    assert features.shape == (2 * model.image_path.layout.tokens_per_image, hidden)  # flat, image by image


def test_an_image_path_that_disagrees_with_the_count_names_the_sample(model):
    """The splice checks the feature rows against the count the prompt reserved: a part whose arithmetic differs is
    one message, not a masked_scatter error deep in torch."""
    n = model.image_path.layout.tokens_per_image
    # the count the prompt reserves; the Q-Former still gives n queries
    model.image_path.layout.tokens_per_image = n + 1
    try:
        with pytest.raises(LavisDsError, match=rf"sample 0 of the batch: image 0 takes {n + 1} placeholder tokens .*"
                                               rf"Blip2Qwen's image path gave {n} feature rows per image"):
            model(_batch())
    finally:
        model.image_path.layout.tokens_per_image = n
    prepared = model.prepare_batch(_batch())
    short = model.image_features(prepared)[:-1]  # flat features one row short: the last image's sample is named
    with pytest.raises(LavisDsError, match=rf"sample 2 of the batch: its 1 image\(s\) take \[{n}\] placeholder "
                                           rf".* has {2 * n - 1} feature rows .* need {2 * n}"):
        model.answer_logps(prepared, image_features=short)


def test_a_cut_into_an_image_is_refused_naming_the_sample(model):
    batch = _batch()
    model.llm.prompt = dataclasses.replace(model.llm.prompt, max_len=_short(model, batch))
    try:
        with pytest.raises(ImageSpanCut, match=r"sample 2 of the micro-batch \(dataset index 9\): max_txt_len=\d+ "
                                               r"would cut the image placeholders .*run.sft.on_image_cut: drop"):
            NextTokenSft(on_image_cut="refuse").prepare(model, _batch())
        with pytest.raises(ImageSpanCut, match="sample 2 of the micro-batch"):
            model(_batch())  # a direct forward refuses too: only the training objective may drop
    finally:
        model.llm.prompt = dataclasses.replace(model.llm.prompt, max_len=512)


@pytest.mark.parametrize("pack", [False, True])
def test_a_cut_sample_is_dropped_with_its_images_and_counted(model, caplog, pack):
    batch = _batch()
    keep = {"image": batch["image"][:1], "num_images": [1, 0], "instruction": batch["instruction"][:2],
            "output": batch["output"][:2], "index": batch["index"][:2]}
    model.llm.prompt = dataclasses.replace(model.llm.prompt, max_len=_short(model, batch))
    before = model.batch.image_cut_drops
    pack_to = 512 if pack else None
    try:
        with caplog.at_level(logging.WARNING):
            dropped = NextTokenSft().prepare(model, _batch(), pack_to)
        kept = model.prepare_batch(keep, pack_to=pack_to)
        assert dropped["index"].tolist() == [4, 7] and dropped["num_images"] == [1, 0]
        assert torch.equal(dropped["image"], batch["image"][:1])
        assert torch.equal(dropped["input_ids"], kept["input_ids"])
        assert model.batch.image_cut_drops == before + 1
        assert "sample 2 of the micro-batch (dataset index 9) dropped" in caplog.text
        with torch.no_grad():
            torch.testing.assert_close(model(dropped)["loss_sum"], model(kept)["loss_sum"])
        # A micro-batch whose samples are all cut still runs a forward (every rank must): nothing supervised.
        only_cut = {"image": batch["image"][1:], "num_images": [1], "instruction": batch["instruction"][2:],
                    "output": batch["output"][2:], "index": batch["index"][2:]}
        blank = NextTokenSft().prepare(model, only_cut, pack_to)
        assert blank["input_ids"].shape == (1, 1) and blank["num_images"] == [0] and blank["image"].shape[0] == 0
        with torch.no_grad():
            out = model(blank)
        assert int(out["num_tokens"]) == 0 and float(out["loss"]) == 0.0
    finally:
        model.llm.prompt = dataclasses.replace(model.llm.prompt, max_len=512)


def test_token_counting_for_a_budget_takes_a_cut_samples_whole_length(model):
    """The token budget's calibration counts a sample truncation would cut into an image (training drops or refuses
    it) at its whole length, instead of stopping the run before it starts."""
    texts = [{"instruction": t, "output": o, "num_images": n} for t, o, n in
             zip(_batch()["instruction"], _batch()["output"], _batch()["num_images"])]
    whole = counted_by(model.prepare_batch)(texts)
    model.llm.prompt = dataclasses.replace(model.llm.prompt, max_len=_short(model, _batch()))
    try:
        assert whole[2] > model.llm.prompt.max_len >= max(whole[:2])  # only the third is cut
        assert counted_by(model.prepare_batch)(texts) == whole
    finally:
        model.llm.prompt = dataclasses.replace(model.llm.prompt, max_len=512)


def test_images_move_by_their_rows_whether_pixels_or_flat_patches():
    """select_images moves an image's block of rows: one row of [N, 3, H, W], or t*h*w patch rows with a grid."""
    pixels = torch.arange(3).view(3, 1, 1, 1).float()
    assert select_images({"image": pixels}, [2, 0])["image"].flatten().tolist() == [2.0, 0.0]
    grid = torch.tensor([[1, 1, 2], [1, 2, 2]])  # 2 and 4 patches
    patches = torch.arange(6).view(6, 1).float()
    moved = select_images({"image": patches, "image_grid_thw": grid}, [1, 0])
    assert moved["image"].flatten().tolist() == [2.0, 3.0, 4.0, 5.0, 0.0, 1.0]
    assert moved["image_grid_thw"].tolist() == [[1, 2, 2], [1, 1, 2]]
    assert image_sizes({"image": patches, "image_grid_thw": grid}) == [(1, 1, 2), (1, 2, 2)]


def test_the_token_budget_counts_each_images_own_tokens():
    """With the image tokens known exactly, a record's estimate follows them, not an average per image: two
    records with one image each, of 64 and of 576 tokens, differ by 512."""
    shapes = [(w, 5 * w, 1, i) for w in range(5, 60, 5) for i in (0, 1, 2)]
    image_tokens = [sum((64, 576)[:i]) for _, _, _, i in shapes]
    exact = [round(1.2 * w + 3 * i + 20) + m for (w, _, _, i), m in zip(shapes, image_tokens)]
    estimate = fit_token_estimate(shapes, exact, longest=4096, image_tokens=image_tokens)
    assert estimate.per_image == pytest.approx(3, abs=0.1)  # the <Img></Img> around each image, text only
    assert estimate.tokens((20, 100, 1, 1), 576) - estimate.tokens((20, 100, 1, 1), 64) == 512
    averaged = fit_token_estimate(shapes, exact, longest=4096)  # without the counts: one figure per image
    assert averaged.tokens((20, 100, 1, 1)) != estimate.tokens((20, 100, 1, 1), 576)


@pytest.mark.parametrize("section, problem", [
    ({"on_image_cut": "skip"}, "run.sft.on_image_cut: expected 'drop' | 'refuse', got 'skip'"),
    ({"on_image_cutt": "drop"}, "run.sft.on_image_cutt: unknown key; did you mean 'on_image_cut'?")])
def test_a_bad_on_image_cut_is_named_with_what_is_valid(section, problem):
    from lavis_ds.objectives.config import objective_problems

    assert objective_problems({"sft": section}) == [problem]
    assert objective_problems({"sft": {"on_image_cut": "refuse"}}) == []


def test_a_prompt_without_a_fixed_count_places_each_images_own(model):
    """A prompt of a model whose count depends on the image reserves what each call gives, per image in order."""
    prompt = dataclasses.replace(model.llm.prompt, num_image_tokens=None)
    ids = prompt.generation_prompt(["<ImageHere> a <ImageHere> b"], (), 2, image_tokens=[3, 5])
    runs = "".join("x" if t == prompt.image_token_id else " " for t in ids).split()
    assert runs == ["xxx", "xxxxx"]
    with pytest.raises(ValueError, match="no fixed count of tokens per image"):
        prompt.training_example(["<ImageHere> a"], ["b"])
