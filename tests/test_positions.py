"""Position providers per LLM family: M-RoPE ids as a pure host function of a sample's tokens and grids, equal to
transformers' ``get_rope_index`` (Qwen2-VL and Qwen2.5-VL), and laid end to end per sample under packing."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLConfig, Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from lavis_ds.common.registry import position_providers
from lavis_ds.models.llm_families import position_provider
from lavis_ds.models.packing import pack
from lavis_ds.models.positions import MultimodalRope, TextPositions, Visual, with_text_row

START, END, IMAGE, VIDEO = 151652, 151653, 151655, 151656  # Qwen2-VL's vision_start/end, image_pad, video_pad
MERGE = 2
TEXT = [101, 102, 103]
# Tiny sizes on the meta device (no memory); the vocabulary holds Qwen's special ids.
TEXT_CONFIG = {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
               "intermediate_size": 32, "vocab_size": 152_000}


def _sample(*parts) -> tuple[list[int], list[tuple[int, tuple[int, int, int]]]]:
    """Token ids as Qwen-VL's processor writes them: text, and ``(kind, grid_thw)`` visuals between vision_start and
    vision_end, ``t*h*w // 4`` pads each. Returns the ids and the visuals in order."""
    ids, visuals = [], []
    for part in parts:
        if isinstance(part, list):
            ids += part
        else:
            kind, grid = part
            ids += [START] + [kind] * (grid[0] * grid[1] * grid[2] // MERGE ** 2) + [END]
            visuals.append(part)
    return ids, visuals


SAMPLES = {
    "text only": _sample(TEXT * 3),
    "one image": _sample(TEXT, (IMAGE, (1, 4, 6)), TEXT + [104]),
    "two images of different grids": _sample([7], (IMAGE, (1, 6, 4)), TEXT, (IMAGE, (1, 2, 8)), TEXT),
    "a video": _sample(TEXT, (VIDEO, (3, 4, 4)), [9, 9]),
    "an image and a video": _sample((IMAGE, (1, 2, 2)), TEXT, (VIDEO, (2, 2, 4)), TEXT),
}


def _reference(model, ids: list[int], visuals, **extra) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    kinds = torch.tensor([[1 if t == IMAGE else 2 if t == VIDEO else 0 for t in ids]])
    grids = {kind: torch.tensor([g for k, g in visuals if k == kind]) for kind in (IMAGE, VIDEO)}
    grids = {kind: grid if len(grid) else None for kind, grid in grids.items()}
    positions, deltas = model.get_rope_index(input_ids, kinds, image_grid_thw=grids[IMAGE],
                                             video_grid_thw=grids[VIDEO], **extra)
    return positions[:, 0], int(deltas[0, 0])


def _ours(ids, visuals, intervals=None) -> torch.Tensor:
    intervals = intervals or [1.0] * len(visuals)
    mine = [Visual(t * h * w // MERGE ** 2, (t, h // MERGE, w // MERGE), interval)
            for (_, (t, h, w)), interval in zip(visuals, intervals)]
    return MultimodalRope().positions(ids, [IMAGE, VIDEO], mine)


@pytest.fixture(scope="module")
def qwen2_vl():
    with torch.device("meta"):  # get_rope_index reads the config only: no weights needed
        return Qwen2VLModel(Qwen2VLConfig(text_config=TEXT_CONFIG, vision_config={
            "depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2}))


@pytest.fixture(scope="module")
def qwen2_5_vl():
    with torch.device("meta"):
        return Qwen2_5_VLModel(Qwen2_5_VLConfig(
            text_config=TEXT_CONFIG, vision_config={"depth": 1, "hidden_size": 16, "out_hidden_size": 16,
                                                    "num_heads": 2, "intermediate_size": 32, "tokens_per_second": 4}))


@pytest.mark.parametrize("name", list(SAMPLES))
def test_mrope_ids_and_delta_equal_qwen2_vls_get_rope_index(qwen2_vl, name):
    ids, visuals = SAMPLES[name]
    theirs, delta = _reference(qwen2_vl, ids, visuals)
    ours = _ours(ids, visuals)
    assert torch.equal(ours, theirs)
    assert MultimodalRope().rope_delta(ours) == delta


@pytest.mark.parametrize("name", ["a video", "an image and a video", "two images of different grids"])
def test_mrope_ids_equal_qwen2_5_vls_with_video_time_in_seconds(qwen2_5_vl, name):
    """Qwen2.5-VL spaces a video's temporal ids by tokens_per_second * second_per_grid_t (images: 1)."""
    ids, visuals = SAMPLES[name]
    seconds = [0.7 if kind == VIDEO else None for kind, _ in visuals]  # 4 tokens/s x 0.7 s: ids 0, 2, 5 (truncated)
    videos = [s for s in seconds if s is not None]
    theirs, delta = _reference(qwen2_5_vl, ids, visuals,
                               second_per_grid_ts=torch.tensor(videos) if videos else None)
    ours = _ours(ids, visuals, [4 * s if s is not None else 1.0 for s in seconds])
    assert torch.equal(ours, theirs) and MultimodalRope().rope_delta(ours) == delta


def test_families_take_their_provider_and_a_plain_llm_takes_1d():
    assert set(position_providers) >= {"rope_1d", "mrope"}
    text_config = Qwen2VLConfig().text_config
    assert isinstance(position_provider(text_config), MultimodalRope)
    assert isinstance(position_provider(Qwen2_5_VLConfig().text_config), MultimodalRope)
    from transformers import Qwen2Config
    plain = position_provider(Qwen2Config())  # a Qwen-VL tower on a plain LLM: 1-D positions
    ids, visuals = SAMPLES["one image"]
    assert isinstance(plain, TextPositions) and torch.equal(plain.positions(ids, [IMAGE], []),
                                                             torch.arange(len(ids))[None])
    four = with_text_row(_ours(ids, visuals))
    assert four.shape == (4, len(ids)) and torch.equal(four[0], torch.arange(len(ids)))


def test_packed_mrope_ids_are_each_samples_own_end_to_end():
    samples = [SAMPLES[name] for name in ("one image", "text only", "a video", "two images of different grids")]
    own = [_ours(ids, visuals) for ids, visuals in samples]
    examples = [(ids, [-100] * len(ids)) for ids, _ in samples]
    packed = pack(examples, 60, 0, -100, own)
    rope, filled = packed["rope_position_ids"], packed["attention_mask"].sum(1).tolist()
    assert rope.shape[0] == 3 and rope.shape[1:] == packed["input_ids"].shape
    starts = iter(range(len(packed["order"])))
    laid = {}
    for row, row_len in enumerate(filled):
        at = 0
        while at < row_len:
            sample = packed["order"][next(starts)]
            laid[sample] = rope[:, row, at:at + len(samples[sample][0])]
            at += len(samples[sample][0])
        assert torch.equal(rope[:, row, row_len:], packed["position_ids"][row, row_len:].expand(3, -1))  # tails
    assert len(laid) == len(samples) and all(torch.equal(laid[i], own[i]) for i in range(len(samples)))
    assert len(filled) > 1  # the plan really put several rows


def test_a_grid_that_disagrees_with_the_count_is_refused():
    with pytest.raises(ValueError, match=r"a visual of 5 tokens cannot have the grid \(1, 2, 2\)"):
        Visual(5, (1, 2, 2))
    ids, visuals = SAMPLES["one image"]
    with pytest.raises(ValueError, match="has no visual left"):
        MultimodalRope().positions(ids, [IMAGE], [])
