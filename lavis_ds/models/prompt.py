"""ChatML prompts with a placeholder run per image (0..N per sample), and their loss mask.

A training example is tokenized segment by segment, so the mask is exact by
construction: every token of an assistant answer and its closing ``<|im_end|>``
is supervised, every other token (system prompt, user turns, the role headers,
the ``\\n`` after ``<|im_end|>``, the image placeholders) gets ``IGNORE_INDEX``.
Generation prompts are built from the same segments, so the model sees at
inference exactly the tokens it was trained on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # what torch's cross_entropy skips by default
IMAGE_HERE = "<ImageHere>"  # MiniGPT4Qwen's marker for where the image goes
DEFAULT_IMAGE_PREFIX = f"<Img>{IMAGE_HERE}</Img> "

Turns = Sequence[str]


def as_turns(value: str | Turns) -> list[str]:
    """A sample's instruction or output as a list of turns (a bare string is one turn)."""
    return [value] if isinstance(value, str) else list(value)


def insert_image_placeholders(instructions: Turns, image_token: str, num_image_tokens: int,
                              num_images: int = 1) -> list[str]:
    """Replace each ``<ImageHere>`` by ``num_image_tokens`` copies of ``image_token``.

    Every image has its own marker, in the order of the images (a video's frames are
    images here: the dataset repeats its marker per frame), so each image's features
    land where its marker stands. A sample with no image has no marker. One image may
    go unmarked: it is then put in front of the first turn as ``<Img><ImageHere></Img> ``
    (COCO-caption style data has no marker).
    """
    turns = list(instructions)
    if not turns:
        raise ValueError("a sample needs at least one instruction turn")
    markers = sum(turn.count(IMAGE_HERE) for turn in turns)
    if markers == 0 and num_images == 1:
        turns[0] = DEFAULT_IMAGE_PREFIX + turns[0]
    elif markers != num_images:
        raise ValueError(f"{num_images} image(s) but {markers} {IMAGE_HERE} marker(s) in {turns!r}: "
                         "each image needs its own marker, in image order")
    return [turn.replace(IMAGE_HERE, image_token * num_image_tokens) for turn in turns]


def chatml_segments(
    system_prompt: str, instructions: Turns, answers: Turns, add_generation_prompt: bool = False
) -> list[tuple[str, bool]]:
    """The prompt as ``(text, supervised)`` pieces, in order.

    Training (``add_generation_prompt=False``) needs one answer per instruction.
    Generation needs the answers of all turns but the last (a reference answer for
    the last turn, if given, is ignored) and ends with ``<|im_start|>assistant\\n``.
    """
    instructions, answers = list(instructions), list(answers)
    history = len(instructions) - 1 if add_generation_prompt else len(instructions)
    if len(answers) < history or (not add_generation_prompt and len(answers) != len(instructions)):
        raise ValueError(
            f"{len(instructions)} instruction turn(s) but {len(answers)} answer(s): "
            "each instruction needs its answer (generation may leave out the last one)"
        )
    segments = [(f"<|im_start|>system\n{system_prompt}<|im_end|>\n", False)]
    for instruction, answer in zip(instructions[:history], answers[:history]):
        segments.append((f"<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n", False))
        segments.append((f"{answer}<|im_end|>", True))
        # The newline closes the turn template; it is not part of what the assistant says.
        segments.append(("\n", False))
    if add_generation_prompt:
        segments.append((f"<|im_start|>user\n{instructions[-1]}<|im_end|>\n<|im_start|>assistant\n", False))
    return segments


@dataclass(frozen=True)
class ChatPrompt:
    """Turns MiniGPT4Qwen samples into token ids (and labels) for one tokenizer.

    Attributes:
        tokenizer: A ChatML tokenizer that knows ``image_token`` as a single token.
        system_prompt: Text of the system turn.
        image_token: Placeholder token whose embeddings the image features replace.
        num_image_tokens: Placeholders per image (the Q-Former's query count).
        max_len: Longest training sequence, in tokens.
    """

    tokenizer: PreTrainedTokenizerBase
    system_prompt: str
    image_token: str
    num_image_tokens: int
    max_len: int

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.image_token)

    def training_example(self, instructions: str | Turns, answers: str | Turns,
                         num_images: int = 1) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one sample with ``num_images`` images, truncated to ``max_len`` tokens.

        Truncation keeps the start and cuts the end: cutting into the image placeholders
        would leave fewer slots than image features. If ``max_len`` is too short to keep
        all of them, that is a config error.
        """
        instructions = insert_image_placeholders(as_turns(instructions), self.image_token, self.num_image_tokens,
                                                 num_images)
        segments = chatml_segments(self.system_prompt, instructions, as_turns(answers))
        input_ids, labels = self._tokenize(segments, num_images)
        if len(input_ids) > self.max_len and num_images:
            last_image_pos = max(i for i, t in enumerate(input_ids) if t == self.image_token_id)
            if last_image_pos >= self.max_len:
                raise ValueError(
                    f"max_txt_len={self.max_len} would cut the image placeholders of a sample "
                    f"(the last one is token {last_image_pos}); raise max_txt_len"
                )
            input_ids, labels = input_ids[: self.max_len], labels[: self.max_len]
        return input_ids, labels

    def generation_prompt(self, instructions: str | Turns, answers: str | Turns = (), num_images: int = 1) -> list[int]:
        """Token ids up to ``<|im_start|>assistant\\n`` of the last turn; earlier turns keep their answers.

        ``num_images`` other than 1: the instructions mark each image with ``<ImageHere>``, in image order.
        Not truncated: cutting the end would drop the question or the assistant header.
        """
        instructions = insert_image_placeholders(as_turns(instructions), self.image_token, self.num_image_tokens,
                                                 num_images)
        segments = chatml_segments(self.system_prompt, instructions, as_turns(answers), add_generation_prompt=True)
        return self._tokenize(segments, num_images)[0]

    def _tokenize(self, segments: list[tuple[str, bool]], num_images: int = 1) -> tuple[list[int], list[int]]:
        input_ids: list[int] = []
        labels: list[int] = []
        for text, supervised in segments:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            input_ids += ids
            labels += ids if supervised else [IGNORE_INDEX] * len(ids)
        placeholders = input_ids.count(self.image_token_id)
        if placeholders != num_images * self.num_image_tokens:
            # A literal image token in user text, or a tokenizer that splits the image token.
            raise ValueError(
                f"expected {num_images * self.num_image_tokens} {self.image_token} tokens in the prompt "
                f"({num_images} image(s)), found {placeholders}"
            )
        return input_ids, labels


def pad_batch(
    sequences: Sequence[Sequence[int]], pad_value: int, side: Literal["left", "right"]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest sequence: ``(padded [B, T] long, attention_mask [B, T] long)``.

    Training pads on the right; generation pads on the left so every prompt ends
    where the new tokens start.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    length = max(len(s) for s in sequences)
    padded = torch.full((len(sequences), length), pad_value, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        span = slice(length - len(seq), length) if side == "left" else slice(0, len(seq))
        padded[row, span] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, span] = 1
    return padded, mask


def image_counts(samples: dict[str, Any]) -> list[int]:
    """Images per sample of a batch: its ``num_images``, else one each (batches made before 0..N images);
    ``ValueError`` unless they add up to the rows of its flat ``image`` tensor (none without one)."""
    counts = samples.get("num_images")
    counts = [1] * len(samples["instruction"]) if counts is None else [int(n) for n in counts]
    image = samples.get("image")
    total = 0 if image is None else image.shape[0]
    if sum(counts) != total or len(counts) != len(samples["instruction"]):
        raise ValueError(f"num_images {counts} adds up to {sum(counts)} images, but the batch holds {total} "
                         f"(for {len(samples['instruction'])} sample(s))")
    return counts
