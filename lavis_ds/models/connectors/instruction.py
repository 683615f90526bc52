"""InstructBLIP's host-side step: each image's instruction, BERT-tokenized for the Q-Former.

The tokenizer is bert-base-uncased plus ``[DEC]`` (vocabulary 30523), a local folder: the
``qformer_tokenizer/`` that ``InstructBlipProcessor.save_pretrained`` writes, or LAVIS's
``BertTokenizer.from_pretrained("bert-base-uncased")`` + ``add_special_tokens({"bos_token": "[DEC]"})``
saved with ``save_pretrained``. LAVIS truncates on the left and pads to the longest instruction.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch

from lavis_ds.models.parts import PartError
from lavis_ds.models.prompt import IMAGE_HERE, as_turns, image_counts

# What marks an image in an instruction: the markers carry no words for the Q-Former.
_MARKUP = re.compile(r"<Img>\s*" + re.escape(IMAGE_HERE) + r"\s*</Img>|" + re.escape(IMAGE_HERE) + "|<image>")


def load_qformer_tokenizer(folder: str | None, vocab_size: int, path: str = "connector.qformer_tokenizer"):
    """The BERT tokenizer in ``folder``; one ``PartError`` line if it is not there or does not fit the Q-Former."""
    from transformers import AutoTokenizer

    hint = ("the Q-Former's BERT tokenizer (bert-base-uncased plus [DEC], as InstructBlipProcessor saves it "
            "under qformer_tokenizer/)")
    if not folder:
        raise PartError(f"{path}: required: a local folder with {hint}")
    where = Path(folder).expanduser()
    if not where.is_dir() or not (any(where.glob("tokenizer*")) or (where / "vocab.txt").is_file()):
        raise PartError(f"{path}: {where} is not a tokenizer folder; expected {hint}. An InstructBLIP folder keeps "
                        "it in its qformer_tokenizer/ subfolder")
    tokenizer = AutoTokenizer.from_pretrained(str(where), truncation_side="left")
    if len(tokenizer) > vocab_size:
        raise PartError(f"{path}: {where} has {len(tokenizer)} tokens, more than the Q-Former's {vocab_size} word "
                        "embeddings (qformer.vocab_size); InstructBLIP's is bert-base-uncased + [DEC] = 30523")
    return tokenizer


def image_instructions(samples: Mapping[str, Any]) -> list[str]:
    """One text per image of the batch, in image order: the turn that holds the image's marker (an unmarked
    single image: the first turn), its image markup removed."""
    texts = []
    for turns, count in zip(samples["instruction"], image_counts(samples), strict=True):
        turns = as_turns(turns)
        marked = [i for i, turn in enumerate(turns) for _ in range(turn.count(IMAGE_HERE))]
        owners = marked if len(marked) == count else [0] * count
        texts += [" ".join(_MARKUP.sub(" ", turns[i]).split()) for i in owners]
    return texts


def tokenize_instructions(tokenizer, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """``qformer_input_ids`` and ``qformer_attention_mask`` ``[N, L]``: padded to the longest, truncated on the
    left to ``max_length`` (LAVIS's settings), as ``InstructBlipProcessor`` names them."""
    encoded = tokenizer(texts, padding="longest", truncation=True, max_length=max_length, return_tensors="pt")
    return {"qformer_input_ids": encoded["input_ids"], "qformer_attention_mask": encoded["attention_mask"]}
