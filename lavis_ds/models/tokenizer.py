"""Train tiny tokenizers, for demos and tests that cannot download the real ones.

``train_chatml_tokenizer``: a byte-level BPE with Qwen2's normalizer and pre-tokenizer, saved
as a Hugging Face Qwen2 tokenizer folder, so ``AutoTokenizer.from_pretrained``
returns a ``Qwen2Tokenizer`` with the same special tokens and roles as the
Qwen chat models (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos/unk).
``train_family_tokenizer``: the same BPE with another family's special tokens and roles
(``FAMILIES``: Qwen3, Llama 3, Gemma, Phi-3) and a chat template of that family.
``train_bert_tokenizer``: a lower-casing WordPiece vocabulary (whole words and characters) with BERT's pipeline
and special tokens plus ``[DEC]`` as its bos, saved as a ``BertTokenizerFast`` folder: the shape of InstructBLIP's
Q-Former tokenizer (bert-base-uncased + ``[DEC]``) at a demo's size.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast
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


@dataclass(frozen=True)
class TokenizerFamily:
    """A family's special tokens and their roles, as its published tokenizer_config.json names them."""

    special_tokens: tuple[str, ...]
    eos: str
    bos: str | None = None
    pad: str | None = None  # None: the family's tokenizer has none (Llama 3); lavis_ds pads with eos
    added_tokens: tuple[str, ...] = ()  # added, but not special (Qwen3's <think>)
    fast_class: type = PreTrainedTokenizerFast


FAMILIES = {
    "qwen2.5": TokenizerFamily(SPECIAL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>",
                               fast_class=Qwen2TokenizerFast),
    "qwen3": TokenizerFamily(SPECIAL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>",
                             added_tokens=("<think>", "</think>"), fast_class=Qwen2TokenizerFast),
    # Qwen3.5: Qwen3's roles, and the vision tokens its template writes for images and videos.
    "qwen3.5": TokenizerFamily((*SPECIAL_TOKENS, "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
                               eos="<|im_end|>", pad="<|endoftext|>", added_tokens=("<think>", "</think>"),
                               fast_class=Qwen2TokenizerFast),
    # Llama 3.x Instruct; <|reserved_special_token_0|> is the image placeholder of the llama3 presets.
    "llama3": TokenizerFamily(("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                               "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                               "<|python_tag|>", "<|finetune_right_pad_id|>"),
                              bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "gemma": TokenizerFamily(("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
                             bos="<bos>", eos="<eos>", pad="<pad>"),
    "phi3": TokenizerFamily(("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>",
                             "<|user|>"), bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>"),
}


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
    bpe = _train_bpe(texts, vocab_size, special_tokens)

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
    return _save(tokenizer, out_dir)


def train_family_tokenizer(family: str, texts: Iterable[str], out_dir: str | os.PathLike, chat_template: str,
                           vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on ``texts`` and save it with ``FAMILIES[family]``'s tokens and ``chat_template``.

    A stand-in for tests and docs: the text splits into other pieces than the real
    tokenizer's, but the special tokens, their roles and the template are the family's.
    """
    spec = FAMILIES[family]
    specials = list(spec.special_tokens)
    if vocab_size < len(BYTE_ALPHABET) + len(specials):
        raise ValueError(f"vocab_size must be at least {len(BYTE_ALPHABET) + len(specials)}, got {vocab_size}")
    roles = {"eos_token": spec.eos, "bos_token": spec.bos, "pad_token": spec.pad}
    tokenizer = spec.fast_class(
        tokenizer_object=_train_bpe(texts, vocab_size, specials), unk_token=None, **roles,
        additional_special_tokens=[t for t in specials if t not in roles.values()],
        model_max_length=32768, chat_template=chat_template)
    if spec.added_tokens:
        tokenizer.add_tokens(list(spec.added_tokens))
    return _save(tokenizer, out_dir)


BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_bert_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512) -> Path:
    """Build a lower-casing WordPiece vocabulary from ``texts`` and save it as a BERT tokenizer folder with ``[DEC]``
    added as its bos token, as LAVIS and ``InstructBlipProcessor`` make the Q-Former's (``[CLS] text [SEP]``).
    The same texts and ``vocab_size`` give byte-identical files (``_wordpiece_vocab``)."""
    from tokenizers import processors
    from transformers import BertTokenizerFast

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = [word for text in texts for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))]
    wordpiece = Tokenizer(models.WordPiece(_wordpiece_vocab(words, vocab_size), unk_token="[UNK]"))
    wordpiece.normalizer, wordpiece.pre_tokenizer, wordpiece.decoder = normalizer, pre_tokenizer, decoders.WordPiece()
    cls_id, sep_id = wordpiece.token_to_id("[CLS]"), wordpiece.token_to_id("[SEP]")
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id),
                                                                                   ("[SEP]", sep_id)])
    tokenizer = BertTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]", sep_token="[SEP]",
                                  pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]", do_lower_case=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    return _save(tokenizer, out_dir)


def _wordpiece_vocab(words: Sequence[str], vocab_size: int) -> dict[str, int]:
    """BERT's special tokens, every character of ``words`` alone and as a ``##`` continuation (so each word of the
    corpus splits without ``[UNK]``), then whole words, most frequent first, up to ``vocab_size`` tokens.
    Every order is sorted: tokenizers' ``WordPieceTrainer`` numbers the ``##`` characters in its hash maps' order,
    which differs per process, and so does its choice among merges of equal count (another vocabulary each run)."""
    counts = Counter(words)
    characters = sorted({char for word in counts for char in word})
    continuations = sorted({f"##{char}" for word in counts for char in word[1:]})
    tokens = [*BERT_SPECIAL_TOKENS, *characters, *continuations]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be at least {len(tokens)} (special tokens and the texts' characters), "
                         f"got {vocab_size}")
    known = set(tokens)
    tokens += [word for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
               if word not in known][:vocab_size - len(tokens)]
    return {token: index for index, token in enumerate(tokens)}


def _train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
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
    return bpe


def _save(tokenizer: PreTrainedTokenizerFast, out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return out
