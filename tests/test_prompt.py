"""ChatML prompt building, the loss mask, truncation, padding, and the toy tokenizer."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoTokenizer

from lavis_ds.models.prompt import (
    DEFAULT_IMAGE_PREFIX,
    IGNORE_INDEX,
    ChatPrompt,
    chatml_segments,
    insert_image_placeholders,
    pad_batch,
)
from lavis_ds.models.tokenizer import train_chatml_tokenizer

SYSTEM = "You are a helpful assistant."
IMG = "<|image_pad|>"
N_IMG = 4


@pytest.fixture
def prompt(tiny_tokenizer) -> ChatPrompt:
    return ChatPrompt(tiny_tokenizer, SYSTEM, IMG, N_IMG, max_len=512)


def supervised_runs(tokenizer, input_ids, labels) -> list[str]:
    """Decode each contiguous run of supervised tokens (one per assistant turn)."""
    runs = []
    for supervised, group in itertools.groupby(zip(input_ids, labels), key=lambda p: p[1] != IGNORE_INDEX):
        pairs = list(group)
        if supervised:
            assert all(i == lab for i, lab in pairs)  # labels are the tokens themselves
            runs.append(tokenizer.decode([i for i, _ in pairs]))
    return runs


def test_image_marker_becomes_placeholder_run():
    turns = insert_image_placeholders(["<Img><ImageHere></Img> What is it?", "And now?"], IMG, 3)
    assert turns == [f"<Img>{IMG * 3}</Img> What is it?", "And now?"]


def test_missing_image_marker_is_prepended_to_first_turn():
    turns = insert_image_placeholders(["What is it?", "And now?"], IMG, 2)
    assert turns == [DEFAULT_IMAGE_PREFIX.replace("<ImageHere>", IMG * 2) + "What is it?", "And now?"]


def test_a_marker_count_other_than_the_image_count_is_an_error():
    with pytest.raises(ValueError, match=r"1 image\(s\) but 2 <ImageHere> marker\(s\).*each image needs its own marker"):
        insert_image_placeholders(["<ImageHere> a", "<ImageHere> b"], IMG, 2)
    with pytest.raises(ValueError, match=r"0 image\(s\) but 1 <ImageHere> marker"):
        insert_image_placeholders(["<ImageHere> a"], IMG, 2, num_images=0)


def test_markers_of_several_images_and_of_none():
    turns = insert_image_placeholders(["<Img><ImageHere></Img> a", "<Img><ImageHere><ImageHere></Img> b"], IMG, 2,
                                      num_images=3)
    assert turns == [f"<Img>{IMG * 2}</Img> a", f"<Img>{IMG * 4}</Img> b"]
    assert insert_image_placeholders(["Hi", "How?"], IMG, 2, num_images=0) == ["Hi", "How?"]


def test_segments_spell_chatml():
    text = "".join(t for t, _ in chatml_segments(SYSTEM, ["Q1", "Q2"], ["A1", "A2"]))
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n"
    )
    generation = "".join(t for t, _ in chatml_segments(SYSTEM, ["Q1", "Q2"], ["A1", "A2"], add_generation_prompt=True))
    assert generation.endswith("<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
    assert "A1<|im_end|>" in generation and "A2" not in generation


def test_training_needs_one_answer_per_turn():
    with pytest.raises(ValueError, match="2 instruction turn"):
        chatml_segments(SYSTEM, ["Q1", "Q2"], ["A1"])


def test_single_turn_supervises_exactly_the_answer_and_im_end(prompt, tiny_tokenizer):
    ids, labels = prompt.training_example(["<Img><ImageHere></Img> What is in the image?"], ["A cat sitting on a mat."])
    assert len(ids) == len(labels)
    assert supervised_runs(tiny_tokenizer, ids, labels) == ["A cat sitting on a mat.<|im_end|>"]
    assert tiny_tokenizer.decode(ids) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n<Img>{IMG * N_IMG}</Img> What is in the image?"
        "<|im_end|>\n<|im_start|>assistant\nA cat sitting on a mat.<|im_end|>\n"
    )
    # The trailing newline after <|im_end|> is not supervised.
    assert tiny_tokenizer.decode(ids[-1:]) == "\n" and labels[-1] == IGNORE_INDEX


def test_multi_turn_supervises_every_answer(prompt, tiny_tokenizer):
    answers = ["A dog.", "It is red.", "Two."]
    ids, labels = prompt.training_example(
        ["<Img><ImageHere></Img> What is in the image?", "What color is the ball?", "How many animals are there?"],
        answers,
    )
    assert supervised_runs(tiny_tokenizer, ids, labels) == [a + "<|im_end|>" for a in answers]
    assert ids.count(prompt.image_token_id) == N_IMG


def test_bare_strings_are_single_turns(prompt):
    assert prompt.training_example("What is it?", "A cat.") == prompt.training_example(["What is it?"], ["A cat."])


def test_truncation_cuts_the_end_and_keeps_the_image(tiny_tokenizer):
    full = ChatPrompt(tiny_tokenizer, SYSTEM, IMG, N_IMG, max_len=10_000)
    ids, labels = full.training_example(["What is in the image?"], ["A dog runs on the grass next to a red ball."])
    cut = ChatPrompt(tiny_tokenizer, SYSTEM, IMG, N_IMG, max_len=len(ids) - 5)
    cut_ids, cut_labels = cut.training_example(["What is in the image?"], ["A dog runs on the grass next to a red ball."])
    assert cut_ids == ids[: len(ids) - 5] and cut_labels == labels[: len(ids) - 5]
    assert cut_ids.count(full.image_token_id) == N_IMG


def test_truncation_never_cuts_image_placeholders(tiny_tokenizer):
    too_short = ChatPrompt(tiny_tokenizer, SYSTEM, IMG, N_IMG, max_len=12)
    with pytest.raises(ValueError, match="max_txt_len=12 would cut the image placeholders"):
        too_short.training_example(["What is it?"], ["A cat."])


def test_literal_image_token_in_text_is_an_error(prompt):
    with pytest.raises(ValueError, match=f"expected {N_IMG}"):
        prompt.training_example([f"<ImageHere> look: {IMG}"], ["A cat."])


def test_generation_prompt_ends_at_assistant_header(prompt, tiny_tokenizer):
    ids = prompt.generation_prompt(["<Img><ImageHere></Img> What is in the image?", "What color is the ball?"],
                                   ["A red ball.", "reference answer, ignored"])
    text = tiny_tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat color is the ball?<|im_end|>\n<|im_start|>assistant\n")
    assert "A red ball.<|im_end|>" in text and "ignored" not in text
    # The prefix is token-for-token what training saw.
    train_ids, _ = prompt.training_example(["<Img><ImageHere></Img> What is in the image?", "What color is the ball?"],
                                           ["A red ball.", "Red."])
    assert train_ids[: len(ids)] == ids


def test_pad_batch_right_and_left():
    ids, mask = pad_batch([[1, 2, 3], [4]], pad_value=0, side="right")
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_batch([[1, 2, 3], [4]], pad_value=0, side="left")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long


# ----------------------------------------------------------------- toy tokenizer
def test_toy_tokenizer_loads_as_qwen2_chatml(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert type(tokenizer).__name__.startswith("Qwen2Tokenizer")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"):
        assert tokenizer(special, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(special)]
    text = "Ünïcode and emoji 🙂 are bytes too."
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_toy_tokenizer_is_deterministic(tmp_path):
    texts = ["a cat on a mat", "a dog on a log"] * 3
    first = train_chatml_tokenizer(texts, tmp_path / "a", vocab_size=300)
    second = train_chatml_tokenizer(texts, tmp_path / "b", vocab_size=300)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and "tokenizer.json" in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_toy_tokenizer_rejects_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be at least 260"):
        train_chatml_tokenizer(["x"], tmp_path, vocab_size=100)
