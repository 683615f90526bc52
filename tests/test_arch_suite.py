"""What works on blip2_qwen works on every registered architecture, in-process on its tiny preset: LoRA, the
token-normalised loss, packing with 0..N images and video frames, batched generation and chat. (The engines,
SIGKILL resume and packed runs on real processes: test_arch_runs; the FLOP model: test_flops.)"""
from __future__ import annotations

from itertools import count

import pytest
import torch
from PIL import Image

from archs import ARCHITECTURES, build_tiny, image_side, without_dropout
from lavis_ds.apps.chat_session import ChatSession
from lavis_ds.datasets.processor_sections import build_processor
from lavis_ds.datasets.instruction import expand_video_marker

QUESTIONS = ["What colour is the shape?", "Describe the picture.", "Are the two the same?", "What shape is it?",
             "What happens in the video?", "Say something."]
ANSWERS = ["Red.", "A small blue circle on grey.", "No, the second is larger.", "A square.",
           "The shape grows darker frame by frame.", "Hello there."]
IMAGES = [0, 1, 2, 1, 3, 0]  # per sample; sample 4 is a video of 3 frames


def _samples(model, seed: int = 0) -> dict:
    """Six samples: text-only, one image, two images, a 3-frame video (one marker per frame)."""
    generator = torch.Generator().manual_seed(seed)
    instructions = []
    for n, question in zip(IMAGES, QUESTIONS):
        if n == 3:
            instructions.append(expand_video_marker(["<Img><ImageHere></Img> " + question], n))
        else:
            instructions.append([("" if n == 0 else "<Img>" + "<ImageHere>" * n + "</Img> ") + question])
    side = image_side(model)
    return {"image": torch.randn(sum(IMAGES), 3, side, side, generator=generator), "num_images": list(IMAGES),
            "instruction": instructions, "output": [[a] for a in ANSWERS]}


def _model(arch, tiny_tokenizer_dir, tmp_path, **overrides):
    torch.manual_seed(0)
    return build_tiny(arch, tiny_tokenizer_dir, tmp_path, **without_dropout(arch), **overrides)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packing_keeps_each_samples_images_and_frames_with_it(arch, tiny_tokenizer_dir, tmp_path):
    model = _model(arch, tiny_tokenizer_dir, tmp_path).eval()
    batch = _samples(model)
    prepared = model.prepare_batch(dict(batch))
    padded = model(prepared)
    longest = int(prepared["attention_mask"].sum(dim=1).max())
    # The shortest rows that lay the samples out in another order: the images must follow their samples.
    packed_batch = next(packed for row in range(longest, 3 * longest)
                        if (packed := model.prepare_batch(dict(batch), pack_to=row))["order"] != list(range(6)))
    assert torch.allclose(model(packed_batch)["loss_sum"], padded["loss_sum"], rtol=1e-5, atol=0)
    swapped = dict(batch, image=batch["image"].flip(0))  # the same images, each in another sample's place
    assert not torch.allclose(model(model.prepare_batch(swapped))["loss_sum"], padded["loss_sum"], rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_token_normalised_loss_of_split_micro_batches_is_the_whole_batchs(arch, tiny_tokenizer_dir, tmp_path):
    """The summed token losses of two micro-batches over their supervised tokens together: the loss and gradients of
    the whole batch (run.loss_reduction: tokens), though the micro-batches hold different numbers of tokens."""
    model = _model(arch, tiny_tokenizer_dir, tmp_path).eval()
    batch = _samples(model)
    whole = model(batch)
    whole["loss"].backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    first, second = _split(batch, 2), _split(batch, 2, second=True)
    outs = [model(part) for part in (first, second)]
    tokens = sum(out["num_tokens"] for out in outs)
    assert outs[0]["num_tokens"] != outs[1]["num_tokens"] and tokens == whole["num_tokens"]
    loss = sum(out["loss_sum"] for out in outs) / tokens
    loss.backward()
    assert torch.allclose(loss, whole["loss"], rtol=1e-5)
    mean_of_means = (outs[0]["loss"] + outs[1]["loss"]) / 2
    # What the token rule is not: ten times further off than the rule's own tolerance (a randomly initialised LLM's
    # token losses are all near log(vocabulary), so the two rules differ by 6e-4 on tiny qwen3_5).
    assert not torch.allclose(mean_of_means, whole["loss"], rtol=1e-4)
    for name, grad in expected.items():
        # On the tensor's own scale: fp32 sums in another order differ by ~1e-7 of it, a wrong weighting by ~1e-1;
        # the floor is for gradients that are 0 in exact arithmetic (attention's key bias) and rounding here.
        error = float((model.get_parameter(name).grad - grad).abs().max())
        assert error <= 1e-5 * float(grad.abs().max()) + 1e-7, (name, error, float(grad.abs().max()))


def _split(batch: dict, at: int, second: bool = False) -> dict:
    images = sum(batch["num_images"][:at])
    pick = slice(at, None) if second else slice(0, at)
    return {"image": batch["image"][images:] if second else batch["image"][:images],
            **{k: batch[k][pick] for k in ("num_images", "instruction", "output")}}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_trains_only_its_adapters_and_merges_into_the_same_model(arch, tiny_tokenizer_dir, tmp_path):
    model = _model(arch, tiny_tokenizer_dir, tmp_path, get_lora=True, freeze_llm=True, lora_r=4)
    llm_trainable = {n for n, p in model.named_parameters() if p.requires_grad and n.startswith("llm_model.")}
    assert llm_trainable and all("lora_" in n for n in llm_trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = _samples(model)
    model(batch)["loss"].backward()
    optimizer.step()
    model.eval()
    before = model(batch)["loss"]
    merged = model.merge_lora()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert torch.allclose(model(batch)["loss"], before, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_generation_answers_as_one_sample_at_a_time(arch, tiny_tokenizer_dir, tmp_path):
    model = _model(arch, tiny_tokenizer_dir, tmp_path).eval()
    batch = _samples(model)
    del batch["output"]
    together = model.generate(batch, max_new_tokens=6)
    starts = [0, *torch.tensor(IMAGES).cumsum(0).tolist()]
    alone = [model.generate({"image": batch["image"][starts[i]:starts[i + 1]], "num_images": [IMAGES[i]],
                             "instruction": [batch["instruction"][i]]}, max_new_tokens=6)[0] for i in range(6)]
    assert together == alone and len(set(together)) > 1


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_chat_answers_each_turn_as_generate_does_with_the_history(arch, tiny_tokenizer_dir, tmp_path):
    model = _model(arch, tiny_tokenizer_dir, tmp_path).eval()
    processor = build_processor({"name": "blip2_image_eval", "image_size": image_side(model)})
    session = ChatSession(model, processor)
    session.set("max_new_tokens", "6")
    colours = count(40, 90)
    pictures = [Image.new("RGB", (40, 30), (next(colours), 120, 30)) for _ in range(2)]
    for picture in pictures:
        session.add_image(picture)
    first = "".join(session.ask(QUESTIONS[0]))
    second = "".join(session.ask(QUESTIONS[3]))
    pixels = torch.stack([processor(p) for p in pictures])
    marked = "<Img><ImageHere></Img> <Img><ImageHere></Img> " + QUESTIONS[0]
    expected_first = model.generate({"image": pixels, "num_images": [2], "instruction": [[marked]]},
                                    max_new_tokens=6)[0]
    expected_second = model.generate({"image": pixels, "num_images": [2], "instruction": [[marked, QUESTIONS[3]]],
                                      "output": [[expected_first]]}, max_new_tokens=6)[0]
    assert (first.strip(), second.strip()) == (expected_first, expected_second)
