"""A batch's samples as the LLM receives them (token ids, labels, padded or packed), and where each sample of a
prepared batch sits: its images in packed order, the sample of each supervised position; and the batch without the
samples truncation would cut into an image (``prepare_batch``'s ``on_image_cut: drop``).

``HostBatch`` is the part a model holds for it (``model.batch``: its ``prepare_batch``). ``training_examples`` and
``lay_out`` are the one path from samples to what trains: ``HostBatch.prepare`` calls them, and so does
``lavis_ds.show_sample`` (through ``token_batch``), which shows those very ids.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Literal

import torch

from lavis_ds.common.errors import ImageSpanCut
from lavis_ds.models.chat_llm import ChatLLM
from lavis_ds.models.chat_template import ChatTemplateError
from lavis_ds.models.image_layout import ImageLayout
from lavis_ds.models.image_tokens import (FRAME_SECONDS_KEY, GRID_KEY, SECONDS_KEY, SIZES_KEY, Size, image_sizes,
                                           per_sample, select_images)
from lavis_ds.models.lm_loss import supervised_positions
from lavis_ds.models.packing import pack
from lavis_ds.models.prompt import IGNORE_INDEX, ChatPrompt, image_counts, pad_batch, pad_positions

logger = logging.getLogger(__name__)

# Fields with a row (or block of rows) per image, not per sample.
IMAGE_KEYS = ("image", GRID_KEY, SIZES_KEY, SECONDS_KEY, FRAME_SECONDS_KEY)
Example = tuple[list[int], list[int]]  # a sample's (input_ids, labels)


def sample_names(samples: dict[str, Any]) -> list[str]:
    """How messages name each sample of a batch: its ``where`` (its record's file and position; a pair's side),
    else its place in the micro-batch and its dataset index."""
    count = len(samples["instruction"])
    if samples.get("where") is not None and None not in samples["where"]:
        return list(samples["where"])
    index = samples.get("index")
    return [f"sample {i} of the micro-batch" + ("" if index is None else f" (dataset index {int(index[i])})")
            for i in range(count)]


def training_examples(prompt: ChatPrompt, samples: dict[str, Any],
                      image_tokens: list[list[int]] | None = None) -> list[Example | ImageSpanCut]:
    """``(input_ids, labels)`` of each sample: its turns, its images' placeholder counts (``image_tokens``, a list per
    sample; None: the prompt's fixed count), its own system turn (if any). A video is marked as the prompt writes it
    (``ChatPrompt.video_marks``). A sample that truncation would cut into
    an image gives its :class:`ImageSpanCut`, naming it, in its place: the caller refuses or drops it."""
    names = sample_names(samples)
    systems = samples.get("system") or [None] * len(names)
    counts = image_tokens if image_tokens is not None else [None] * len(names)
    videos = per_sample(prompt.video_marks(samples), image_counts(samples))  # a video's placeholders: the video token
    examples: list[Example | ImageSpanCut] = []
    for name, instructions, answers, num_images, system, mine, my_videos in zip(
            names, samples["instruction"], samples["output"], image_counts(samples), systems, counts, videos,
            strict=True):
        try:
            examples.append(prompt.training_example(instructions, answers, num_images, image_tokens=mine,
                                                    system=system, videos=my_videos))
        except ImageSpanCut as cut:
            examples.append(cut.at(name))
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{name}: {e}") from None
    return examples


def lay_out(examples: list[Example], pad_id: int, pack_to: int | None = None,
            rope: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """The LLM's fields of a batch: ``input_ids``, ``attention_mask``, ``labels`` padded on the right (with each
    sample's M-RoPE rows ``rope``: ``rope_position_ids``), or with ``pack_to`` the samples laid end to end in rows
    of at most that many tokens (``models.packing``: adds ``position_ids``, per-sample lengths and the packed
    ``order``)."""
    if pack_to is not None:
        return with_supervised_positions(pack(examples, pack_to, pad_id, IGNORE_INDEX, rope))
    input_ids, attention_mask = pad_batch([ids for ids, _ in examples], pad_id, side="right")
    labels, _ = pad_batch([lab for _, lab in examples], IGNORE_INDEX, side="right")
    fields = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if rope is not None:
        fields["rope_position_ids"] = pad_positions(rope, input_ids.shape[1], side="right")
    return with_supervised_positions(fields)


def with_supervised_positions(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` and the ``supervised_positions`` of their ``labels`` (``lm_loss``), found on the host; whoever
    replaces a prepared batch's labels calls this again."""
    return {**fields, "supervised_positions": supervised_positions(fields["labels"])}


def token_batch(prompt: ChatPrompt, samples: dict[str, Any], pad_id: int, pack_to: int | None = None,
                tokens_for_image: Callable[[Size], int] | None = None) -> dict[str, Any]:
    """What ``prepare_batch`` lays out for a batch, from the model's prompt alone (no weights): each image takes the
    prompt's fixed count, or ``tokens_for_image`` of its size where the count depends on it (the processor's, which
    counts as the model does); a sample truncation would cut into an image is refused."""
    counts = None if tokens_for_image is None else per_sample(
        [tokens_for_image(size) for size in image_sizes(samples)], image_counts(samples))
    examples = training_examples(prompt, samples, counts)
    for example in examples:
        if isinstance(example, ImageSpanCut):
            raise example
    return lay_out(examples, pad_id, pack_to)


def packed_image_order(samples: dict[str, Any]) -> torch.Tensor:
    """Indices into the flat image tensor (each sample's images a block, in sample order) that list the images in
    the packed order of their samples."""
    counts = image_counts(samples)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return torch.tensor([starts[i] + k for i in samples["order"] for k in range(counts[i])], dtype=torch.long)


def sample_of_positions(samples: dict[str, Any], positions: torch.Tensor, labels: torch.Tensor
                        ) -> tuple[torch.Tensor, int]:
    """``(owner, num_samples)``: the sample (index in ``samples["instruction"]``) of each supervised position
    (``lm_loss.supervised_positions``: flat, row-major, as ``lm_loss.token_logps`` lists them).

    Padded, a row is a sample. Packed (``position_ids``), a sample starts where its positions restart at 0 inside
    a row's filled part (``attention_mask`` 1); the tails restart at 0 too but are never filled nor supervised.
    The packed samples are laid out in ``samples["order"]``.
    """
    if "position_ids" not in samples:
        return positions // labels.shape[1], labels.shape[0]
    positions_in_sample = samples["position_ids"].to(labels.device)
    filled = samples["attention_mask"].to(labels.device).bool()
    starts = (positions_in_sample == 0) & filled
    packed_index = starts.flatten().cumsum(0) - 1  # which packed sample each position belongs to, flat
    order = torch.tensor(samples["order"], dtype=torch.long, device=labels.device)
    # Position t predicts token t+1, which belongs to the same sample: a sample's first token is never supervised.
    return order[packed_index[positions + 1]], len(samples["order"])


def log_drop(where: str, cut: ImageSpanCut, dropped: int) -> None:
    """The first few drops, then every hundredth: a log, not a flood; the count is this process's."""
    if dropped <= 5 or dropped % 100 == 0:
        logger.warning("lavis_ds: %s dropped: model.max_txt_len=%d would cut its image placeholders (its %d tokens, "
                       "the last placeholder at token %d); %d sample(s) dropped so far in this process "
                       "(run.sft.on_image_cut: drop)", where, cut.max_len, cut.length, cut.last_image_pos, dropped)


def keep_samples(samples: dict[str, Any], kept: list[int]) -> dict[str, Any]:
    """The batch with only the samples ``kept`` (indices, in order), each with its images. A field is per sample if
    it lists one entry per sample (a list, or a tensor whose first dimension is the batch's samples)."""
    size = len(samples["instruction"])
    counts = image_counts(samples)
    starts = [sum(counts[:i]) for i in range(size)]
    out = {**samples, **select_images(samples, [starts[i] + k for i in kept for k in range(counts[i])])}
    for key, value in samples.items():
        if key in IMAGE_KEYS or not isinstance(value, (list, tuple, torch.Tensor)) or len(value) != size:
            continue
        out[key] = value[torch.tensor(kept, dtype=torch.long)] if torch.is_tensor(value) else [value[i] for i in kept]
    if "image" in out and not sum(counts[i] for i in kept):
        out["image"] = samples["image"][:0]
    return out


def blank_sample(samples: dict[str, Any]) -> dict[str, Any]:
    """A one-sample batch without images or text, standing in for a micro-batch whose samples were all dropped."""
    kept = keep_samples(samples, [0])
    return {**kept, **select_images(samples, []), "instruction": [[""]], "output": [[""]], "num_images": [0],
            **({"image": samples["image"][:0]} if samples.get("image") is not None else {})}


class HostBatch:
    """The host side of a vision-LLM's batch (``model.batch``): each sample rendered through the LLM's prompt with
    its images' placeholders as the image layout counts them, its M-RoPE positions where the LLM family takes more
    than one row, the image path's host inputs; laid out padded or packed (``prepare``)."""

    def __init__(self, llm: ChatLLM, images: ImageLayout, host_inputs: Callable[[dict[str, Any]], dict[str, Any]]):
        """``host_inputs``: what the image path needs computed on the host beside the images (an instruction
        connector's tokens, ``ImagePath.host_inputs``)."""
        self.llm, self.images, self.host_inputs = llm, images, host_inputs
        self.image_cut_drops = 0  # samples prepare dropped in this process (on_image_cut: drop), for the log

    def prepare(self, samples: dict[str, Any], pack_to: int | None = None,
                on_image_cut: Literal["drop", "refuse"] = "refuse") -> dict[str, Any]:
        """The prompts rendered and tokenized on the host: ``input_ids``, ``attention_mask``, ``labels``, each image's
        placeholder count ``image_tokens`` added (and the image path's ``host_inputs``). A batch that has ``labels`` is
        already prepared and returned as given (with the image layout's host fields: a grid as host rows).

        ``pack_to``: lay the samples end to end in rows of at most that many tokens instead of padding each
        (``position_ids``, per-sample lengths and the packed ``order`` added; see ``models.packing``).
        ``on_image_cut``: a sample that ``max_txt_len`` would cut inside (or before) an image's placeholders is
        refused (``ImageSpanCut`` naming it) or dropped from the batch with its images, and counted in the log."""
        if "labels" in samples:
            return self.images.host_fields(samples)
        examples, samples = self._examples(samples, on_image_cut)
        extra = {**self.host_inputs(samples), "image_tokens": self.images.counts(samples)}
        rope = self.rope_positions([ids for ids, _ in examples], samples)
        return self.images.host_fields({**samples, **extra, **lay_out(examples, self.llm.pad_id, pack_to, rope)})

    def rope_positions(self, sequences: list[list[int]], samples: dict[str, Any]) -> list[torch.Tensor] | None:
        """Each sample's ``[rows, L]`` position ids from the LLM family's provider, when it takes more than one row
        (M-RoPE); None for 1-D families, whose positions are ``0..L-1`` (packing's ``position_ids``)."""
        provider = self.llm.positions
        if provider.rows == 1:
            return None
        runs, placeholders = self.images.runs(samples), self.llm.prompt.placeholder_ids
        return [provider.positions(ids, placeholders, mine) for ids, mine in zip(sequences, runs, strict=True)]

    def _examples(self, samples: dict[str, Any], on_image_cut: str) -> tuple[list[Example], dict[str, Any]]:
        """Each sample's ``(input_ids, labels)`` and the batch they belong to: ``samples``, or without the samples
        truncation would cut into an image (``on_image_cut: drop``; a batch left empty keeps one blank sample)."""
        counts = per_sample(self.images.counts(samples), image_counts(samples))
        examples = training_examples(self.llm.prompt, samples, counts)
        kept = [i for i, example in enumerate(examples) if not isinstance(example, ImageSpanCut)]
        if len(kept) == len(examples):
            return examples, samples
        for cut in (example for example in examples if isinstance(example, ImageSpanCut)):
            if on_image_cut != "drop":
                raise cut
            self.image_cut_drops += 1
            log_drop(cut.where, cut, self.image_cut_drops)
        if not kept:  # every rank runs a forward (ZeRO-3 / FSDP collectives): one token, nothing supervised
            return [([self.llm.pad_id], [IGNORE_INDEX])], blank_sample(samples)
        return [examples[i] for i in kept], keep_samples(samples, kept)
