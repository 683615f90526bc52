"""run.batch_unit: tokens: micro-batches filled to a token budget, planned from estimated sample lengths."""
from __future__ import annotations

import random

import pytest
from PIL import Image

from archs import build_tiny
from conftest import demo_storage_fixture
from lavis_ds.datasets.instruction import InstructionDataset
from lavis_ds.datasets.lengths import TokenEstimate, counted_by, fit_token_estimate, shape_of, token_length_of
from lavis_ds.datasets.samplers import StepBatchSampler, TokenBudgetSampler, fill_rows
from lavis_ds.models.blip2_qwen import Blip2Qwen
from lavis_ds.processors import Blip2ImageEvalProcessor
from lavis_ds.processors.qwen_vl import GRID_KEY, QwenVLImageProcessor
from test_images_per_sample import MPP_MULTI_IMAGE, MPP_VIDEO, write_data, write_json

LENGTHS = [r.choice([3, 40, 120, 300]) + r.randint(0, 30) for r in map(random.Random, range(400))]


def _length_of(index: int, epoch: int) -> int:
    return LENGTHS[index]


def _sampler(rows=2, row_len=1024, accum=1, world=1, rank=0, epochs=2) -> TokenBudgetSampler:
    return TokenBudgetSampler(len(LENGTHS), rows, row_len, accum, world, rank, seed=3, length_of=_length_of,
                              epochs=epochs)


def _steps(world: int, accum: int, epoch: int = 0, start: int = 0) -> list[list[int]]:
    """Per optimizer step: every rank's samples, together."""
    samplers = [_sampler(accum=accum, world=world, rank=rank)
                for rank in range(world)]
    for s in samplers:
        s.set_position(epoch, start)
    per_rank = [list(s) for s in samplers]
    return [sorted(i for r in per_rank for mb in r[k * accum:(k + 1) * accum] for i in mb)
            for k in range(len(per_rank[0]) // accum)]


def test_fill_rows_fills_every_row_and_keeps_each_sample_once():
    lengths = [6, 9, 3, 7, 2, 4, 10, 1]
    batches = fill_rows(list(range(8)), lengths, rows=2, row_len=10, lookahead=2)
    # 6 and 3 in one row, 9 in the other; 7 and 2 fit in neither and wait: two waiting close the micro-batch.
    # The next starts with them (7 + 2 + 1, 4), and 10 waits for the last.
    assert batches == [[0, 1, 2], [3, 4, 5, 7], [6]]
    assert fill_rows(list(range(8)), lengths, 2, 10, 2) == batches  # a function of its arguments
    assert fill_rows([0, 1], [30, 5], 1, 10) == [[0], [1]]  # too long for a row: a micro-batch of its own


def _fits(micro_batch: list[int], rows: int, row_len: int) -> bool:
    """Whether first fit in the plan's order lays ``micro_batch`` into ``rows`` rows."""
    free = [row_len] * rows
    for i in micro_batch:
        row = next((r for r, room in enumerate(free) if room >= LENGTHS[i]), None)
        if row is None:
            return False
        free[row] -= LENGTHS[i]
    return True


def test_every_micro_batch_fits_its_rows_and_steps_do_not_overlap():
    sampler = _sampler(accum=2)
    micro_batches = list(sampler)
    assert all(_fits(mb, 2, 1024) for mb in micro_batches)
    used = sum(LENGTHS[i] for mb in micro_batches for i in mb) / (len(micro_batches) * 2 * 1024)
    assert used > 0.97, used  # the rows are nearly full: short samples fill the room long ones leave
    flat = [i for mb in micro_batches for i in mb]
    assert len(flat) == len(set(flat)) and len(micro_batches) == sampler.steps_per_epoch * 2
    assert len(sampler) == len(micro_batches)


def test_the_steps_do_not_depend_on_the_number_of_processes():
    """An elastic resume keeps accumulation x processes, so it takes the same steps; and so does a resumed rerun."""
    assert _steps(world=2, accum=2) == _steps(world=1, accum=4) == _steps(world=4, accum=1)
    assert _steps(world=2, accum=2, epoch=1, start=3) == _steps(world=2, accum=2, epoch=1)[3:]
    assert _steps(world=2, accum=2, epoch=0) != _steps(world=2, accum=2, epoch=1)


def test_every_epoch_takes_the_fewest_steps_any_epoch_has():
    sampler = _sampler(rows=1, row_len=400, epochs=6)
    counts = [len(sampler.plan(epoch)) for epoch in range(6)]
    assert len(set(counts)) > 1 and sampler.steps_per_epoch == min(counts)


def test_a_step_samples_the_same_data_as_the_sample_counted_order():
    """The plan cuts the permutation StepBatchSampler draws from: the same shuffle, cut by tokens."""
    tokens = _sampler(rows=len(LENGTHS), epochs=1)
    samples = StepBatchSampler(len(LENGTHS), len(LENGTHS), 1, 1, 0, seed=3)
    assert list(tokens) == list(samples)


def test_too_few_tokens_for_one_step_is_a_clear_error():
    with pytest.raises(ValueError, match=r"fill fewer micro-batches of 40 x 1024 tokens than one optimizer step "
                                         r"takes \(2 accumulation x 2 processes\)"):
        _sampler(rows=40, accum=2, world=2)


def test_the_token_estimate_recovers_a_linear_law_and_ignores_truncated_samples():
    rng = random.Random(0)
    shapes = []
    for _ in range(200):
        words = rng.randint(0, 400)
        shapes.append((words, words * rng.randint(3, 9), rng.randint(1, 6), rng.randint(0, 3)))
    exact = [min(round(0.9 * w + 0.05 * c + 4 * t + 32 * i + 11), 512) for w, c, t, i in shapes]
    estimate = fit_token_estimate(shapes, exact, longest=512)
    assert estimate.per_word == pytest.approx(0.9, abs=0.01) and estimate.per_char == pytest.approx(0.05, abs=0.002)
    assert estimate.per_turn == pytest.approx(4, abs=0.2) and estimate.per_image == pytest.approx(32, abs=0.2)
    assert estimate.fixed == pytest.approx(11, abs=1) and estimate.margin < 0.5  # rounding only
    assert estimate.tokens((10_000, 50_000, 1, 0)) == 512  # never more than the model keeps
    assert TokenEstimate(0, 0, 0, 0, -5, 512).tokens((0, 0, 0, 0)) == 1
    # a law the line cannot follow leaves underestimates: the margin covers nine in ten of them
    noisy = [n + rng.choice([-20, 0, 20]) for n in exact]
    rough = fit_token_estimate(shapes, noisy, longest=10_000)
    under = [n - (rough.tokens(shape) - rough.margin) for shape, n in zip(shapes, noisy)]
    assert 10 < rough.margin and sum(u > rough.margin + 0.5 for u in under) <= 0.1 * len(under)


def test_a_sample_text_and_shape_come_without_reading_an_image(tmp_path, tiny_model_config):
    """text_sample is __getitem__'s text; the estimate fitted on such counts predicts the real training tokens of
    text-only, several-image and video samples (the model's prepare_batch on the loaded sample)."""
    root = write_data(tmp_path / "data", video_frames=6)
    records = [{"instruction": "Hi there, how are you today?", "output": "Hello! Fine, thanks for asking."},
               MPP_MULTI_IMAGE, MPP_VIDEO] * 3
    dataset = InstructionDataset(write_json(tmp_path / "mix.json", records), root,
                                 Blip2ImageEvalProcessor(image_size=16), max_frames=4)
    for index in range(3):
        loaded, text = dataset[index], dataset.text_sample(index)
        keys = ("instruction", "output", "num_images", "system")
        assert {key: text[key] for key in keys} == {key: loaded[key] for key in keys}
        assert text["image_sizes"] == [tuple(image.shape[-2:]) for image in loaded["image"]]
    assert [shape_of(dataset, i)[2:] for i in range(3)] == [(1, 0), (1, 2), (1, 4)]

    model = Blip2Qwen.from_config(tiny_model_config)

    # image tokens fitted per image, or counted exactly
    for tokens_for_image in (None, model.image_path.layout.tokens_for_image):
        length_of = token_length_of(dataset, counted_by(model.prepare_batch), 256, tokens_for_image)
        for index in range(3):
            real = int(model.prepare_batch(dataset.collater([dataset[index]]))["attention_mask"].sum())
            assert abs(length_of(index, 0) - real) <= 2, (index, length_of(index, 0), real)


def test_a_qwen_vl_sample_length_counts_each_image_by_the_grid_its_file_header_gives(tmp_path, tiny_tokenizer_dir):
    """Images at their own sizes (qwen_vl_image): image_sizes gives the grid rows the loaded sample carries, from
    the file headers (a video's from its frame size and count), and the estimate predicts the training tokens of
    text-only, two-image and video samples."""
    root = write_data(tmp_path / "data")  # the video: 10 frames of 32x24 px
    Image.new("RGB", (200, 90), (9, 9, 9)).save(root / MPP_MULTI_IMAGE["image"][1])  # another grid than the first
    model = build_tiny("qwen2_5_vl", tiny_tokenizer_dir, tmp_path)
    text_only = {"instruction": "Hi there, how are you today?", "output": "Hello! Fine, thanks."}
    records = [text_only, MPP_MULTI_IMAGE, MPP_VIDEO] * 3
    dataset = InstructionDataset(write_json(tmp_path / "mix.json", records), root,
                                 QwenVLImageProcessor(**model.vision_tower.processing.processor_keys()), max_frames=8)
    assert dataset.image_sizes(0) == []
    grids = [tuple(row) for row in dataset[1][GRID_KEY].tolist()]
    assert dataset.image_sizes(1) == grids == [(1, 4, 6), (1, 6, 14)]  # 30x40 px resized to 56x84, 90x200 to 84x196
    assert dataset.image_sizes(2) == [tuple(dataset[2][GRID_KEY][0].tolist())] == [(4, 4, 6)]  # 8 frames of 24x32 px at 56x84
    assert dataset.text_sample(2)["num_images"] == dataset[2]["num_images"] == 1  # the video is one visual

    length_of = token_length_of(dataset, counted_by(model.prepare_batch), 256, model.image_path.layout.tokens_for_image)
    for index in range(3):
        real = int(model.prepare_batch(dataset.collater([dataset[index]]))["attention_mask"].sum())
        assert abs(length_of(index, 0) - real) <= 2, (index, length_of(index, 0), real)


@pytest.mark.parametrize("broken, message", [
    ("video", r"mix.json: record 0 \(video 'clip.mp4'\): run.batch_unit: tokens counts a video's tokens by the frame "
              r"size and count in its file's header: cannot read video file .*clip.mp4: .*; fix or remove the file, "
              r"or set run.batch_unit: samples"),
    ("image", r"mix.json: record 0 \(image 'a.png'\): run.batch_unit: tokens counts an image's tokens by the size in "
              r"its file's header, and image file .*a.png has none that reads \(.*\); fix or remove the file, or set "
              r"run.batch_unit: samples")])
def test_a_qwen_vl_visual_whose_header_does_not_read_refuses_the_token_budget_saying_what_to_set(tmp_path, broken,
                                                                                               message):
    from lavis_ds.common.errors import InputError

    (tmp_path / "clip.mp4").write_bytes(b"not a video")
    (tmp_path / "a.png").write_bytes(b"not an image")
    record = {"video": "clip.mp4"} if broken == "video" else {"image": "a.png"}
    dataset = InstructionDataset(write_json(tmp_path / "mix.json", [{**record, "instruction": "<ImageHere> What?",
                                                                     "output": "A."}]), tmp_path,
                                 QwenVLImageProcessor(max_pixels=28 * 28 * 48))
    with pytest.raises(InputError, match=message):
        dataset.text_sample(0)


demo_storage = demo_storage_fixture(num_train=64, num_val=16, num_test=8)


def test_a_token_budget_run_resumed_on_another_number_of_processes_takes_the_same_steps(tmp_path, demo_storage):
    """Packed by tokens on 2 processes (1 row each), checkpointed at step 3 and continued on 1 process (2 rows of
    accumulation): the same global token budget, the same plan, so the curve continues (through train.py)."""
    import shutil

    from run_utils import assert_same_steps, run_train, tiny_config, train_steps, write_yaml

    def config(out):
        cfg = tiny_config(out, demo_storage, micro=1, max_epoch=1, save_freq_steps=3, packing=True, max_seq_len=256)
        cfg["model"]["qformer"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        return cfg

    reference = tmp_path / "reference"
    run_train(write_yaml(tmp_path / "reference.yaml", config(reference)), nproc=2)
    total = len(train_steps(reference))
    assert total > 4
    continued = tmp_path / "continued"
    shutil.copytree(reference / "checkpoints" / "step_3", continued / "checkpoints" / "step_3")
    proc = run_train(write_yaml(tmp_path / "continued.yaml", config(continued)), nproc=0)
    assert "resumed from" in proc.stdout
    assert_same_steps(continued, reference, range(4, total + 1), tolerance=1e-4)
