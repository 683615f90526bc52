"""InstructBLIP's one-call processing: what ``InstructBlipProcessor(images=..., text=...)`` must be given in an export
so that it prepares the ids lavis_ds prepares.

The processor hands the whole prompt it is given (the chat template's ChatML text) to the Q-Former's BERT tokenizer,
while lavis_ds gives the Q-Former the words of the user turn that holds the image, its image markup removed
(``models.connectors.instruction.image_instructions``). The export's ``qformer_tokenizer/`` therefore carries a
normalizer that cuts that turn out of a ChatML prompt before BERT's own normalizer runs; a text that is no ChatML
prompt (an instruction as lavis_ds reads it back) passes unchanged. It is saved as a ``TokenizersBackend``
tokenizer, which loads ``tokenizer.json`` as written (``BertTokenizer`` rebuilds its normalizer from the vocabulary).

The processor also reads ``tokenizer.image_token`` as an ``AddedToken`` (``.content``), which a tokenizer loaded
by transformers 5 never gives (a declared ``image_token`` is a string there), and prepends ``num_query_tokens``
image tokens in front of the whole prompt; :func:`undeclare_image_token` and ``num_query_tokens=0`` leave the image
tokens where the chat template writes them.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

TOKENIZER_CONFIG = "tokenizer_config.json"
# Regex metacharacters of the tokenizers library's Oniguruma syntax; ``re.escape`` also escapes ``<`` and ``>``,
# which Oniguruma may read as word boundaries.
_META = set("\\^$.|?*+()[]{}")


def literal(text: str) -> str:
    """``text`` as an Oniguruma pattern matching itself."""
    return "".join("\\" + ch if ch in _META else ch for ch in text)


def instruction_rules(image_token: str, image_open: str = "<Img>",
                      image_close: str = "</Img>") -> list[tuple[str, str]]:
    """(pattern, replacement) pairs that turn a ChatML prompt into the instruction of its image's user turn.

    In order: drop everything before the content of the first user turn that holds an image; drop the turn's end
    and all after it; replace each image's markup (``<Img>`` + image tokens + ``</Img>``) by a space, as
    ``image_instructions`` does. Without ``<|im_start|>user`` ... ``<Img>`` nothing matches the first two."""
    start, end = literal("<|im_start|>user\n"), literal("<|im_end|>")
    markup = literal(image_open) + "(?:" + literal(image_token) + ")*" + literal(image_close)
    return [("^[\\s\\S]*?" + start + "(?=(?:(?!" + end + ")[\\s\\S])*?" + literal(image_open) + ")", ""),
            (end + "[\\s\\S]*", ""),
            (markup, " ")]


def instruction_tokenizer(bert_tokenizer, image_token: str):
    """A copy of the Q-Former's BERT tokenizer whose normalizer first applies :func:`instruction_rules`."""
    from tokenizers import Regex, normalizers
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(bert_tokenizer.backend_tokenizer)
    rules = [normalizers.Replace(Regex(pattern), replacement)
             for pattern, replacement in instruction_rules(image_token)]
    backend.normalizer = normalizers.Sequence(rules + ([backend.normalizer] if backend.normalizer else []))
    return PreTrainedTokenizerFast(tokenizer_object=backend, truncation_side=bert_tokenizer.truncation_side,
                                   model_max_length=bert_tokenizer.model_max_length,
                                   **bert_tokenizer.special_tokens_map)


def undeclare_image_token(folder: Path) -> None:
    """Remove the ``image_token`` declaration from the tokenizer config in ``folder`` (the token stays in the
    vocabulary); ask the processor to truncate by default.

    Without a declared ``image_token`` ``InstructBlipProcessor`` makes an ``AddedToken("<image>")`` of its own,
    which with ``num_query_tokens=0`` it never writes. ``truncation: true`` among the tokenizer's init arguments is
    what the processor's call hands both tokenizers by default: the Q-Former's then truncates on the left at its
    ``model_max_length`` (the connector's ``max_instruction_len``), as lavis_ds does; the LLM's at its own."""
    path = folder / TOKENIZER_CONFIG
    config = json.loads(path.read_text())
    config.pop("image_token", None)
    specific = config.get("model_specific_special_tokens") or {}
    specific.pop("image_token", None)
    if not specific:
        config.pop("model_specific_special_tokens", None)
    config["truncation"] = True
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
