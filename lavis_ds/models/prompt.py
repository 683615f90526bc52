"""Chat prompts with a placeholder run per image (0..N per sample), and their loss mask.

The prompt is rendered by the tokenizer's own chat template (``lavis_ds.models.chat_template``
derives the answer spans from the render); a tokenizer without one gets ChatML written here,
token for token what lavis_ds wrote before it read templates.
A training example is tokenized segment by segment, so the mask is exact by
construction: every token of an assistant answer and its closing end-of-turn token
(``<|im_end|>`` in ChatML) is supervised, every other token (system prompt, user turns, the role headers,
the ``\\n`` after ``<|im_end|>``, the image placeholders) gets ``IGNORE_INDEX``.
Generation prompts are built from the same segments, so the model sees at
inference exactly the tokens it was trained on.

A sample may bring its own system turn (its record's, ``system=``): it is sent as the template's system message
in place of ``system_prompt``, unless ``record_system_prompt`` says to ignore it or to fold it into the first user
turn (for templates without a system role).
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from lavis_ds.common.errors import ImageSpanCut
from lavis_ds.models.chat_template import (ChatTemplate, ChatTemplateError, check_turns, takes_system_message,
                                           template_text, unstable_render)
from lavis_ds.models.frame_groups import FrameGroups, frame_group_marks
from lavis_ds.models.image_tokens import batch_images, video_flags

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # what torch's cross_entropy skips by default
IMAGE_HERE = "<ImageHere>"  # MiniGPT4Qwen's marker for where the image goes
DEFAULT_IMAGE_PREFIX = f"<Img>{IMAGE_HERE}</Img> "

Turns = Sequence[str]


def as_turns(value: str | Turns) -> list[str]:
    """A sample's instruction or output as a list of turns (a bare string is one turn)."""
    return [value] if isinstance(value, str) else list(value)


def insert_image_placeholders(instructions: Turns, image_token: str | Sequence[str],
                              num_image_tokens: int | Sequence[int], num_images: int = 1,
                              image_span: tuple[str, str] | None = None,
                              frames: Sequence[FrameGroups | None] | None = None) -> list[str]:
    """Replace each ``<ImageHere>`` by ``num_image_tokens`` copies of ``image_token`` (a list: each image's own count,
    in image order, and as many images as it lists). ``image_token`` may be a list too: each image's own
    placeholder token (Qwen-VL's ``<|video_pad|>`` for a video, ``<|image_pad|>`` for an image).

    Every image has its own marker, in the order of the images (a video's frames are
    images here: the dataset repeats its marker per frame), so each image's features
    land where its marker stands. A sample with no image has no marker. One image may
    go unmarked: it is then put in front of the first turn as ``<Img><ImageHere></Img> ``
    (COCO-caption style data has no marker).

    ``image_span``: the text a family's chat template writes around each image's placeholders (Qwen-VL's
    ``<|vision_start|>``, ``<|vision_end|>``). Each marker then becomes ``start + placeholders + end``, MiniGPT4Qwen's
    ``<Img>``/``</Img>`` around markers (and one space after ``</Img>``) are dropped, and an unmarked image goes in
    front of the first turn with nothing between it and the text, as Qwen2-VL's template places an image item.

    ``frames``: per image, the :class:`FrameGroups` of a video written frame group by frame group (inside the
    marker's own span, as Qwen3-VL's processor writes it), or None for one run.
    """
    turns = list(instructions)
    if not turns:
        raise ValueError("a sample needs at least one instruction turn")
    counts = [num_image_tokens] * num_images if isinstance(num_image_tokens, int) else list(num_image_tokens)
    num_images = len(counts)
    markers = sum(turn.count(IMAGE_HERE) for turn in turns)
    if markers == 0 and num_images == 1:
        turns[0] = (DEFAULT_IMAGE_PREFIX if image_span is None else IMAGE_HERE) + turns[0]
    elif markers != num_images:
        raise ValueError(f"{num_images} image(s) but {markers} {IMAGE_HERE} marker(s) in {turns!r}: "
                         "each image needs its own marker, in image order")
    tokens = [image_token] * num_images if isinstance(image_token, str) else list(image_token)
    if len(tokens) != num_images:
        raise ValueError(f"{len(tokens)} placeholder token(s) for {num_images} image(s)")
    # markers in reading order are the images in image order
    groups = list(frames) if frames is not None else [None] * num_images
    runs = iter([token * count if group is None else group.run(token, count)
                 for token, count, group in zip(tokens, counts, groups)])
    start, end = image_span or ("", "")
    if image_span is not None:
        turns = [_without_img_tags(turn) for turn in turns]
    return [re.sub(re.escape(IMAGE_HERE), lambda _: start + next(runs) + end, turn) for turn in turns]


def _without_img_tags(turn: str) -> str:
    """MiniGPT4Qwen's ``<Img>``/``</Img>`` removed where they enclose markers (and one space after ``</Img>``)."""
    marked = f"(?:{re.escape(IMAGE_HERE)})+"
    return re.sub(f"<Img>({marked})</Img> ?", r"\1", turn)


def chatml_segments(
    system_prompt: str | None, instructions: Turns, answers: Turns, add_generation_prompt: bool = False
) -> list[tuple[str, bool]]:
    """The prompt as ``(text, supervised)`` pieces, in order, in ChatML written here (no system turn for None).

    Training (``add_generation_prompt=False``) needs one answer per instruction.
    Generation needs the answers of all turns but the last (a reference answer for
    the last turn, if given, is ignored) and ends with ``<|im_start|>assistant\\n``.
    """
    instructions, answers = list(instructions), list(answers)
    history = check_turns(instructions, answers, add_generation_prompt)
    segments = [] if system_prompt is None else [(f"<|im_start|>system\n{system_prompt}<|im_end|>\n", False)]
    for instruction, answer in zip(instructions[:history], answers[:history]):
        segments.append((f"<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n", False))
        segments.append((f"{answer}<|im_end|>", True))
        # The newline closes the turn template; it is not part of what the assistant says.
        segments.append(("\n", False))
    if add_generation_prompt:
        segments.append((f"<|im_start|>user\n{instructions[-1]}<|im_end|>\n<|im_start|>assistant\n", False))
    return segments


@dataclass(frozen=True)
class PromptLayout:
    """What an architecture's chat template writes besides text and image placeholders (``models.prompt``)."""

    image_span: tuple[str, str] | None = None  # the tokens around each image's placeholders (Qwen-VL's vision span)
    prompt_tokens: tuple[str, ...] = ()  # special tokens the prompt may write: added to a tokenizer that lacks them
    video_token: str | None = None  # a video's own placeholder token; None: a video's placeholders are images'
    video_frame_groups: int | None = None  # frames per timed frame group (Qwen3-VL); None: a video is one run

    def chat_prompt(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None, image_token: str,
                    tokens_per_image: int | None, max_len: int, template_variables: Mapping[str, Any] | None,
                    record_system_prompt: str = "use") -> "ChatPrompt":
        """The ``ChatPrompt`` of a model section's prompt keys laid out as this architecture's template writes them:
        what the built model's LLM part and the config side (``models.settings``) both make."""
        return ChatPrompt(tokenizer, system_prompt, image_token, tokens_per_image, max_len, template_variables or {},
                          record_system_prompt=record_system_prompt, image_span=self.image_span,
                          video_token=self.video_token, video_frame_groups=self.video_frame_groups)


@dataclass(frozen=True)
class ChatPrompt:
    """Turns MiniGPT4Qwen samples into token ids (and labels) for one tokenizer.

    Attributes:
        tokenizer: A tokenizer that knows ``image_token`` as a single token; its chat template renders the
            prompt (ChatML written here if it has none).
        system_prompt: Text of the system turn; None sends none (for templates without a system role).
        image_token: Placeholder token whose embeddings the image features replace.
        num_image_tokens: Placeholders per image when every image takes the same number (the Q-Former's query
            count); None: the callers give each image's count (``image_tokens``), as a model whose count depends on
            the image's size does (``ImageLayout.counts``, the model's ``images``).
        max_len: Longest training sequence, in tokens.
        template_variables: Extra chat-template variables (``enable_thinking: false`` for Qwen3, ...).
        record_system_prompt: What a sample's own system turn does: ``use`` (it is the system message; samples
            without one get ``system_prompt``), ``ignore`` (every sample gets ``system_prompt``), ``fold`` (its text
            and a blank line go in front of the first user turn, as Gemma's templates fold a system message).
        image_span: The text around each image's placeholders (``insert_image_placeholders``); None: the
            placeholders stand where ``<ImageHere>`` stands, inside the data's own ``<Img>...</Img>``.
        video_token: Placeholder token of a video (a visual the batch marks as one, ``image_tokens.video_flags``),
            as the family's processor writes it (Qwen-VL's ``<|video_pad|>``); None: videos take ``image_token``.
        video_frame_groups: Frames per temporal patch where a video is written frame group by frame group, each
            after its time (Qwen3-VL: ``frame_groups``); None: a video is one run of placeholders.
    """

    tokenizer: PreTrainedTokenizerBase
    system_prompt: str | None
    image_token: str
    num_image_tokens: int | None
    max_len: int
    template_variables: Mapping[str, Any] = field(default_factory=dict)
    record_system_prompt: Literal["use", "ignore", "fold"] = "use"
    image_span: tuple[str, str] | None = None
    video_token: str | None = None
    video_frame_groups: int | None = None

    def __post_init__(self) -> None:
        if (why := unstable_render(self.tokenizer, self.template_variables)) is not None:
            logger.warning("%s", why)

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.image_token)

    @functools.cached_property
    def placeholder_ids(self) -> list[int]:
        """Every token id a visual's features replace: the image token's, and the video token's where it has one."""
        video = [] if self.video_token is None else [self.tokenizer.convert_tokens_to_ids(self.video_token)]
        return [self.image_token_id, *video]

    def placeholder_tokens(self, num_images: int, videos: Sequence[bool | FrameGroups] | None) -> list[str]:
        """Each visual's placeholder token: ``video_token`` for the ones ``videos`` marks (where the prompt has one),
        else ``image_token``."""
        marks = list(videos) if videos is not None else [False] * num_images
        if len(marks) != num_images:
            raise ValueError(f"{len(marks)} video mark(s) for {num_images} visual(s)")
        return [self.video_token if video and self.video_token else self.image_token for video in marks]

    def video_marks(self, samples: dict[str, Any]) -> list[bool | FrameGroups]:
        """Each visual's video mark (flat image order): ``video_flags``, or each video's ``FrameGroups`` where the
        prompt writes videos by frame groups."""
        if self.video_frame_groups is None:
            return video_flags(samples)
        return frame_group_marks(samples, self.video_frame_groups, self.image_span or ("", ""))

    @staticmethod
    def frame_groups(videos: Sequence[bool | FrameGroups] | None) -> list[FrameGroups | None] | None:
        """Each visual's :class:`FrameGroups` where ``videos`` gives one (a video written by frame groups)."""
        return None if videos is None else [v if isinstance(v, FrameGroups) else None for v in videos]

    @property
    def end_of_turn_id(self) -> int:
        """The token closing an assistant answer (``<|im_end|>``, ``<|eot_id|>``, ...): where generation stops."""
        if template_text(self.tokenizer) is None:
            return self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return ChatTemplate(self.tokenizer, self.system_prompt, self.template_variables).end_of_turn_id()

    @functools.cached_property
    def takes_system_message(self) -> bool:
        """Whether the chat template renders a system message (Gemma 2's refuses one; ChatML written here takes it)."""
        return template_text(self.tokenizer) is None or takes_system_message(self.tokenizer, self.template_variables)

    def placeholder_counts(self, num_images: int, image_tokens: Sequence[int] | None) -> list[int]:
        """Each image's placeholder count: ``image_tokens`` as given, else ``num_image_tokens`` per image."""
        if image_tokens is not None:
            return list(image_tokens)
        if self.num_image_tokens is None:
            raise ValueError("this prompt has no fixed count of tokens per image: pass each image's count "
                             "(image_tokens, from the model's image_token_counts)")
        return [self.num_image_tokens] * num_images

    def system_and_turns(self, instructions: list[str], system: str | None) -> tuple[str | None, list[str]]:
        """The system message to send and the instructions, for a sample whose own system turn is ``system``."""
        if system is None or self.record_system_prompt == "ignore":
            return self.system_prompt, instructions
        if self.record_system_prompt == "fold":
            return self.system_prompt, [f"{system}\n\n{instructions[0]}", *instructions[1:]]
        if not self.takes_system_message:
            name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise ChatTemplateError(f"the chat template of {name!r} takes no system message, and the sample has its "
                                    f"own ({system[:60]!r}); set model.record_system_prompt: fold (its text goes in "
                                    f"front of the first user turn) or ignore (model.system_prompt for every sample)")
        return system, instructions

    def segments(self, instructions: Turns, answers: Turns, add_generation_prompt: bool = False,
                 system: str | None = None) -> list[tuple[str, bool]]:
        """The conversation as ``(text, supervised)`` pieces: by the tokenizer's chat template, else ChatML.
        ``system``: the sample's own system turn (None: ``system_prompt``)."""
        system, instructions = self.system_and_turns(list(instructions), system)
        if template_text(self.tokenizer) is None:
            return chatml_segments(system, instructions, answers, add_generation_prompt)
        return ChatTemplate(self.tokenizer, system, self.template_variables).segments(
            instructions, list(answers), add_generation_prompt)

    def training_example(self, instructions: str | Turns, answers: str | Turns, num_images: int = 1,
                         image_tokens: Sequence[int] | None = None, system: str | None = None,
                         videos: Sequence[bool | FrameGroups] | None = None) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one sample with ``num_images`` images (and its own system turn ``system``,
        None: ``system_prompt``), truncated to ``max_len`` tokens.

        ``image_tokens``: each image's placeholder count (then ``num_images`` is its length); default
        ``num_image_tokens`` each. ``videos``: which of the visuals are videos (``placeholder_tokens``); a
        :class:`FrameGroups` marks a video written frame group by frame group.
        Truncation keeps the start and cuts the end, never inside or before an image's
        placeholders (fewer slots than features): such a sample raises :class:`ImageSpanCut`.
        """
        counts = self.placeholder_counts(num_images, image_tokens)
        instructions = insert_image_placeholders(as_turns(instructions), self.placeholder_tokens(len(counts), videos),
                                                 counts, image_span=self.image_span,
                                                 frames=self.frame_groups(videos))
        segments = self.segments(instructions, as_turns(answers), system=system)
        input_ids, labels = self._tokenize(segments, counts)
        if len(input_ids) > self.max_len and sum(counts):
            placeholders = set(self.placeholder_ids)
            last_image_pos = max(i for i, t in enumerate(input_ids) if t in placeholders)
            if last_image_pos >= self.max_len:
                raise ImageSpanCut(self.max_len, last_image_pos, len(input_ids))
        return input_ids[: self.max_len], labels[: self.max_len]

    def generation_prompt(self, instructions: str | Turns, answers: str | Turns = (), num_images: int = 1,
                          image_tokens: Sequence[int] | None = None, system: str | None = None,
                          videos: Sequence[bool | FrameGroups] | None = None) -> list[int]:
        """Token ids up to the last turn's assistant header (ChatML: ``<|im_start|>assistant\\n``); earlier turns
        keep their answers.

        ``num_images`` other than 1: the instructions mark each image with ``<ImageHere>``, in image order.
        ``image_tokens`` and ``videos`` as in ``training_example``; ``system``: the conversation's own system turn,
        as there. Not truncated: cutting the end would drop the question or the assistant header.
        """
        counts = self.placeholder_counts(num_images, image_tokens)
        instructions = insert_image_placeholders(as_turns(instructions), self.placeholder_tokens(len(counts), videos),
                                                 counts, image_span=self.image_span,
                                                 frames=self.frame_groups(videos))
        segments = self.segments(instructions, as_turns(answers), add_generation_prompt=True, system=system)
        return self._tokenize(segments, counts)[0]

    def _tokenize(self, segments: list[tuple[str, bool]], counts: Sequence[int]) -> tuple[list[int], list[int]]:
        input_ids: list[int] = []
        labels: list[int] = []
        for text, supervised in segments:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            input_ids += ids
            labels += ids if supervised else [IGNORE_INDEX] * len(ids)
        placeholders = sum(input_ids.count(token) for token in self.placeholder_ids)
        if placeholders != sum(counts):
            # A literal image token in user text, or a tokenizer that splits the image token.
            raise ValueError(
                f"expected {sum(counts)} {'/'.join(filter(None, (self.image_token, self.video_token)))} tokens in the "
                "prompt "
                f"({len(counts)} image(s)), found {placeholders}"
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


def pad_positions(per_sample: Sequence[torch.Tensor], length: int, side: Literal["left", "right"]) -> torch.Tensor:
    """Each sample's ``[k, L]`` position ids padded (with 0, as transformers leaves masked positions) to
    ``[k, B, length]``, on the side ``pad_batch`` pads its tokens."""
    out = torch.zeros((per_sample[0].shape[0], len(per_sample), length), dtype=torch.long)
    for row, ids in enumerate(per_sample):
        span = slice(length - ids.shape[1], length) if side == "left" else slice(0, ids.shape[1])
        out[:, row, span] = ids
    return out


def image_counts(samples: dict[str, Any]) -> list[int]:
    """Images per sample of a batch: its ``num_images``, else one each (batches made before 0..N images);
    ``ValueError`` unless they add up to the rows of its flat ``image`` tensor (none without one)."""
    counts = samples.get("num_images")
    counts = [1] * len(samples["instruction"]) if counts is None else [int(n) for n in counts]
    total = batch_images(samples)
    if sum(counts) != total or len(counts) != len(samples["instruction"]):
        raise ValueError(f"num_images {counts} adds up to {sum(counts)} images, but the batch holds {total} "
                         f"(for {len(samples['instruction'])} sample(s))")
    return counts
