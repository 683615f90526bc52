"""The COCO caption evaluation's tokenisation, without Java.

``pycocoevalcap``'s ``PTBTokenizer`` runs Stanford CoreNLP 3.4.1's
``edu.stanford.nlp.process.PTBTokenizer -preserveLines -lowerCase`` over the
captions and then drops the tokens in its ``PUNCTUATIONS`` list. BLEU and CIDEr
count n-grams of those tokens, so the scores equal the reference only if the
tokens do. This module reproduces that output in Python (CI has no Java):

1. Unicode punctuation is mapped the way the Stanford lexer normalises it:
   curly quotes to `` / '' / ` / ', the ellipsis character to ``...``, em and en
   dashes to ``--``.
2. A scanner takes, in order: runs of ``.`` (``...``), ``--``, runs of ``?``/``!``
   (``!?`` stays one token, as in Stanford), numbers (``5.50``, ``1,000``),
   words - letters/digits joined by inner ``-``, ``/``, ``_``, ``.``, ``&`` or an
   apostrophe (``t-shirt``, ``and/or``, ``o'clock``, ``dog.a``) - and any other
   character as a token of its own.
3. A word followed by ``.`` keeps the period when it is an abbreviation the
   Stanford lexer knows (``mr.``, ``st.``, ``vs.``, ``etc.`` ...) or an acronym
   (``p.m.``, ``e.g.``, ``u.s.``); otherwise the period is a token.
4. Clitics are split as PTB does: ``'s 're 've 'll 'd 'm`` and ``n't`` (``can't``
   -> ``ca n't``, ``won't`` -> ``wo n't``), ``cannot`` -> ``can not``,
   ``gonna/wanna/gotta`` -> ``gon na`` ..., ``y'all`` -> ``y' all``.
5. Brackets become ``-lrb- -rrb- -lsb- -rsb- -lcb- -rcb-``, quotes ``` `` ``` and
   ``''`` (opening/closing), ``$5`` and ``50%`` are split, then everything is
   lowercased - after which pycocoevalcap's list (imported from it, so it is the
   same list) removes ``. , ? ! : ; - -- ... `` '' ` '``. Its list spells the
   brackets in upper case (``-LRB-``), so lowercased brackets are *kept* as
   tokens by the reference; so they are here.

Checked token for token against the Java tokenizer (run here once) on real COCO
captions and on constructed cases with every rule above: see
``tests/test_metrics.py``. Known, deliberately unhandled differences are rare in
captions: Stanford's treatment of ``+``/``=`` inside formulas (``2+2`` ->
``2 +2``), SGML-like ``<tags>``, URLs and e-mail addresses, and its
abbreviation list beyond the common entries in ``_ABBREVIATIONS``.
"""
from __future__ import annotations

import re
from typing import Iterable

from pycocoevalcap.tokenizer.ptbtokenizer import PUNCTUATIONS

__all__ = ["PUNCTUATIONS", "ptb_tokenize", "tokenize_caption"]

_UNICODE = {
    "\u201c": " `` ", "\u201d": " '' ", "\u201e": " `` ",  # “ ” „
    "\u2018": "`", "\u2019": "'", "\u201a": "`",  # ‘ ’ ‚ (’ is also the apostrophe in "don’t")
    "\u2026": " ... ",  # …
    "\u2014": " -- ", "\u2013": " -- ",  # — –
    "\u00a0": " ",  # no-break space
}
_UNICODE_RE = re.compile("|".join(map(re.escape, _UNICODE)))

# Abbreviations whose final period the Stanford lexer keeps (the common part of its list, in lower case).
_ABBREVIATIONS = frozenset("""
mr mrs ms dr prof st sr jr mt ft vs etc co corp inc ltd jan feb mar apr jun jul aug sep sept oct nov dec
ave blvd rd no vol fig gen gov sen rep rev sgt capt col lt cmdr adm messrs esp approx dept est
""".split())
_ACRONYM = re.compile(r"^(?:[a-z]\.)+[a-z]$", re.IGNORECASE)  # "p.m" of "p.m.", "e.g", "u.s.a"
# A single letter keeps its period ("plan B." -> "b.") unless a word of this list follows ("B. The" -> "b .");
# checked against the Java tokenizer word by word ("On", "Yes", "And", "Two" keep it).
_SENTENCE_STARTERS = frozenset("The Then He She It They We There This That A An In But".split())

_WORD_CHAR = r"[^\W_]"  # a letter or digit (not "_")
_TOKEN = re.compile(rf"""
    (?P<dots>\.{{2,}})
  | (?P<dashes>-{{2,}})
  | (?P<marks>[?!]+)
  | (?P<number>\d+(?:[.,:]\d+)+)
  | (?P<decade>'\d+s?\b)
  | (?P<word>{_WORD_CHAR}+(?:(?:[-/_&.]|(?<=[^\W_])'(?=[^\W\d_])){_WORD_CHAR}+)*'?)
  | (?P<other>\S)
""", re.VERBOSE)

_BRACKETS = {"(": "-LRB-", ")": "-RRB-", "[": "-LSB-", "]": "-RSB-", "{": "-LCB-", "}": "-RCB-"}
_SPLIT_WORDS = {"cannot": ("can", "not"), "gonna": ("gon", "na"), "wanna": ("wan", "na"), "gotta": ("got", "ta"),
                "gimme": ("gim", "me"), "lemme": ("lem", "me"), "y'all": ("y'", "all")}
_CLITIC = re.compile(r"^(.+?)('s|'re|'ve|'ll|'d|'m)$", re.IGNORECASE)
_NT = re.compile(r"^(.+?)(n't)$", re.IGNORECASE)


def _keeps_period(word: str, next_word: str | None) -> bool:
    """Whether ``word`` followed by "." is one token (an abbreviation, acronym or initial)."""
    if word.lower() in _ABBREVIATIONS:
        return True
    if len(word) == 1:  # an initial or a letter; "I." is the pronoun and a sentence end
        return word.isalpha() and word.lower() != "i" and next_word not in _SENTENCE_STARTERS
    return bool(_ACRONYM.match(word))


def _split_word(word: str) -> list[str]:
    lower = word.lower()
    if lower in _SPLIT_WORDS:
        return list(_SPLIT_WORDS[lower])
    if "'n'" in lower:  # rock'n'roll -> rock 'n' roll
        head, _, tail = word.partition(word[lower.index("'n'"):lower.index("'n'") + 3])
        return [*_split_word(head), word[len(head):len(head) + 3], *_split_word(tail)]
    if m := _NT.match(word):
        return [m.group(1), m.group(2)]
    if m := _CLITIC.match(word):
        return [m.group(1), m.group(2)]
    return [word]


def ptb_tokenize(text: str) -> list[str]:
    """One line as ``PTBTokenizer -preserveLines -lowerCase`` tokenises it (before punctuation removal)."""
    text = _UNICODE_RE.sub(lambda m: _UNICODE[m.group(0)], text)
    tokens: list[str] = []
    open_double = True  # '"' alternates `` and '' as the lexer's quote context does on a line
    matches = list(_TOKEN.finditer(text))
    for i, m in enumerate(matches):
        if m is None:  # a period taken by the abbreviation before it
            continue
        kind, value = m.lastgroup, m.group(0)
        if kind == "word":
            following = matches[i + 1] if i + 1 < len(matches) else None
            after = matches[i + 2] if i + 2 < len(matches) else None
            takes_period = (following is not None and following.start() == m.end() and following.group(0) == "."
                            and value[-1] != "'" and _keeps_period(value, after and after.group(0)))
            if takes_period:
                value += "."
                matches[i + 1] = None  # type: ignore[call-overload]  # consumed
            trailing_quote = value.endswith("'") and value.lower() != "y'" and len(value) > 1
            if trailing_quote:
                value = value[:-1]
            tokens.extend(_split_word(value))
            if trailing_quote:
                tokens.append("'")
        elif kind == "other":
            if value == '"':
                tokens.append("``" if open_double else "''")
                open_double = not open_double
            elif value == "'":
                tokens.append("`" if not tokens or _opens(text, m.start()) else "'")
            else:
                tokens.append(_BRACKETS.get(value, value))
        else:
            tokens.append(value)
    return [t.lower() for t in tokens]


def _opens(text: str, position: int) -> bool:
    """A single quote at the start of a word opens a quotation (` ); otherwise it closes one (')."""
    before = text[position - 1] if position else " "
    return before.isspace() or before in "([{"


def tokenize_caption(text: str, punctuations: Iterable[str] = PUNCTUATIONS) -> str:
    """What pycocoevalcap's ``PTBTokenizer.tokenize`` makes of one caption: tokens joined by spaces."""
    drop = set(punctuations)
    return " ".join(t for t in ptb_tokenize(text.replace("\n", " ")) if t not in drop)
