"""A run's chat-template variables (``model.chat_template_kwargs``) written into a chat template as its defaults.

Training renders every prompt with the variables passed to ``apply_chat_template`` (``enable_thinking: false`` for
Qwen3, ``date_string`` for Llama 3.x). A folder loaded with transformers is prompted by the default call, which passes
none: transformers 5.x keeps no saved template variables (neither the tokenizer's nor the processor's config holds
any), so the template itself carries them. Each variable the template reads gets a prelude line

    {%- if enable_thinking is not defined -%}{%- set enable_thinking = false -%}{%- endif -%}

in front of the template: the call without arguments renders the trained prompt, and a caller who passes the
variable still chooses. A variable the template does not read changed nothing in training and is left out.

A variable the prelude cannot set as a default is named (:attr:`CarriedVariables.notes`): one transformers always
passes to the template (``messages``, ``tools``, a special token's name such as ``eos_token``), a name Jinja cannot
assign, or a value with no Jinja literal.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

# What apply_chat_template always passes to the template itself (None where the caller gives none): a prelude's
# "is not defined" never holds for them.
PASSED_BY_TRANSFORMERS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
JINJA_KEYWORDS = frozenset({"true", "false", "none", "True", "False", "None", "and", "or", "not", "in", "is", "if",
                            "else", "for", "loop", "self", "namespace"})


class NoJinjaLiteral(ValueError):
    """A value a Jinja template cannot write as a literal (a NaN, an object)."""


@dataclass(frozen=True)
class CarriedVariables:
    """What of a run's template variables a chat template carries as defaults.

    Attributes:
        carried: The variables the prelude sets where the caller passes none.
        notes: One line per variable the template reads but the prelude cannot set, saying why.
    """

    carried: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def prelude(self) -> str:
        """Jinja that sets each carried variable where the caller passes none."""
        return "".join(f"{{%- if {name} is not defined -%}}{{%- set {name} = {jinja_literal(value)} -%}}{{%- endif -%}}"
                       for name, value in self.carried.items())


def jinja_literal(value: Any) -> str:
    """``value`` as a Jinja expression that evaluates to it (JSON's ``null`` is Jinja's ``none``); NoJinjaLiteral
    for a value without one."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise NoJinjaLiteral(f"{value!r} has no Jinja literal")
        return repr(value)
    if isinstance(value, str):  # a JSON string literal is a Jinja one: quotes, newlines, non-ASCII unchanged
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{jinja_literal(str(k))}: {jinja_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(jinja_literal(v) for v in value) + "]"
    raise NoJinjaLiteral(f"{value!r} ({type(value).__name__}) has no Jinja literal")


def template_reads(template: str) -> frozenset[str]:
    """The variables ``template`` reads from its caller (transformers' own introspection of a chat template, which
    ``processor.apply_chat_template`` uses to tell template variables from processor arguments)."""
    from transformers.utils.chat_template_utils import _get_template_variables

    return _get_template_variables(template)


def carried_variables(template: str, variables: Mapping[str, Any],
                      special_tokens: Iterable[str] = ()) -> CarriedVariables:
    """Which of ``variables`` ``template`` carries as defaults, and why the others it reads are not carried.

    ``special_tokens``: the names of the tokenizer's special tokens (``special_tokens_map``), which transformers
    passes to every render."""
    reads = template_reads(template)
    passed = set(PASSED_BY_TRANSFORMERS) | set(special_tokens)
    carried, notes = {}, []
    for name, value in variables.items():
        if name not in reads:
            continue  # the render never depended on it
        why = _why_not_carried(name, value, passed)
        if why is None:
            carried[name] = value
        else:
            notes.append(f"model.chat_template_kwargs.{name} ({value!r}) shaped every trained prompt, but the "
                         f"exported chat template cannot default to it: {why}; pass {name}={value!r} to "
                         "apply_chat_template")
    return CarriedVariables(carried, notes)


def settable(variables: Mapping[str, Any]) -> CarriedVariables:
    """The ``variables`` a prelude can set whatever template follows it (``carried_variables`` for one template)."""
    passed = set(PASSED_BY_TRANSFORMERS)
    return CarriedVariables({name: value for name, value in variables.items()
                             if _why_not_carried(name, value, passed) is None})


def _why_not_carried(name: str, value: Any, passed: set[str]) -> str | None:
    if name in passed:
        return "transformers passes that variable to every render itself"
    if not name.isidentifier() or name in JINJA_KEYWORDS:
        return "Jinja cannot assign a variable of that name"
    try:
        jinja_literal(value)
    except NoJinjaLiteral as e:
        return str(e)
    return None


def with_defaults(template: str, variables: Mapping[str, Any],
                  special_tokens: Iterable[str] = ()) -> tuple[str, CarriedVariables]:
    """``template`` with the prelude of the ``variables`` it carries, and what it carries."""
    carried = carried_variables(template, variables, special_tokens)
    return carried.prelude() + template, carried


def save_tokenizer_with_defaults(tokenizer: Any, variables: Mapping[str, Any], folder: str | Path) -> list[str]:
    """``tokenizer.save_pretrained(folder)`` with ``variables`` as its chat template's defaults (every named template
    of a tokenizer that has several); ``tokenizer`` itself is left as it was. Returns the notes of variables a template
    reads but cannot carry."""
    original = getattr(tokenizer, "chat_template", None)
    if not original or not variables:
        tokenizer.save_pretrained(folder)
        return []
    special = list(tokenizer.special_tokens_map)
    named = original if isinstance(original, dict) else {None: original}
    rewritten, notes = {}, []
    for name, template in named.items():
        rewritten[name], carried = with_defaults(template, variables, special)
        notes += [note for note in carried.notes if note not in notes]
    tokenizer.chat_template = rewritten if isinstance(original, dict) else rewritten[None]
    try:
        tokenizer.save_pretrained(folder)
    finally:
        tokenizer.chat_template = original
    return notes
