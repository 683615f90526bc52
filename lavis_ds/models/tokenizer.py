"""Train a tiny Qwen2-style ChatML tokenizer, for demos and tests that cannot download Qwen's.

The result is a byte-level BPE with Qwen2's normalizer and pre-tokenizer, saved
as a Hugging Face Qwen2 tokenizer folder, so ``AutoTokenizer.from_pretrained``
returns a ``Qwen2Tokenizer`` with the same special tokens and roles as the
Qwen chat models (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos/unk).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2TokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

# Special tokens of Qwen2 / Qwen2.5 chat tokenizers that lavis_ds relies on.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>")
# Every byte gets a token, so no text is ever unknown.
BYTE_ALPHABET = pre_tokenizers.ByteLevel.alphabet()

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_chatml_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512,
                           special_tokens: Sequence[str] = SPECIAL_TOKENS) -> Path:
    """Train a byte-level BPE on ``texts`` and save it as a Qwen2 tokenizer folder.

    ``<Img>`` and ``</Img>`` are left to the BPE, as in Qwen's own tokenizer. The
    same texts (in the same order) and ``vocab_size`` give byte-identical files.

    Args:
        texts: Training corpus, e.g. the instructions and answers of a dataset.
        out_dir: Folder to write (created if missing).
        vocab_size: Largest vocabulary size, special tokens included. Fewer
            tokens result when the corpus has fewer merges to learn.
        special_tokens: The special tokens, ``<|endoftext|>`` (the pad) first. Fewer
            than the default make tokenizers like other families': Qwen2's has no
            ``<|image_pad|>``, a non-chat one no ChatML tokens (eos is then ``<|endoftext|>``).

    Returns:
        ``out_dir`` as a ``Path``.
    """
    special_tokens = list(special_tokens)
    if not special_tokens or special_tokens[0] != "<|endoftext|>":
        raise ValueError(f"special_tokens must start with the pad token <|endoftext|>, got {special_tokens}")
    if vocab_size < len(BYTE_ALPHABET) + len(special_tokens):
        raise ValueError(f"vocab_size must be at least {len(BYTE_ALPHABET) + len(special_tokens)} "
                         f"(256 bytes + special tokens), got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    # The same pipeline Qwen2Tokenizer rebuilds around a vocab, so training and use split text alike.
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=BYTE_ALPHABET,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)

    # Tokens named here that the BPE lacks would be added: name only those it has.
    eos = "<|im_end|>" if "<|im_end|>" in special_tokens else "<|endoftext|>"
    # `tokenizer_object` and `additional_special_tokens` are spelled alike in transformers 4 and 5.
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=bpe,
        eos_token=eos,
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[t for t in special_tokens if t not in (eos, "<|endoftext|>")],
        model_max_length=32768,
        chat_template=CHATML_TEMPLATE,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return out
