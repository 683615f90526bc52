"""Prompts rendered by the tokenizer's own chat template, and the answer-only loss mask taken from the render.

A template is Jinja text that turns messages into the model's prompt format (ChatML,
Llama 3 headers, Gemma turns, ...). The mask is derived from what the template
writes, never from a hand-written copy of the format:

- A template with ``{% generation %}`` blocks marks what the assistant writes itself:
  those character spans are supervised (what ``apply_chat_template(...,
  return_assistant_tokens_mask=True)`` reports, as character spans).
- Otherwise each assistant turn is found by rendering prefixes of the conversation:
  the render up to the turn's user message (``before``), the same with the generation
  prompt, and the render through the assistant turn. What the turn adds after the
  generation prompt header is its answer; whitespace after the end-of-turn token is
  template layout, which generation stops before and never writes, so it is not
  supervised. A template for which those renders do not extend one another raises
  ``ChatTemplateError``: its mask cannot be derived exactly.

In the whole conversation, a turn before the last user message may render shorter than
when it was the newest (Qwen3 drops the empty ``<think>`` block of ``enable_thinking: false``
from its header, and the reasoning block a thinking answer starts with from the answer):
its answer is then found after the longest part of the generation header that stands
there, whole or without its leading lines; what the render holds of it is supervised. The prompt is handed on as
``(text, supervised)`` pieces, tokenized piece by piece, so the mask is exact whatever
the tokenizer merges, and generation prompts cut into the same pieces as training.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerBase

from lavis_ds.common.errors import InputError

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
Segments = list[tuple[str, bool]]


class ChatTemplateError(InputError, ValueError):
    """A chat template this module cannot render a sample with, or cannot derive an exact answer mask from."""


def template_text(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's default chat template (None: it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the one apply_chat_template uses by default
        template = template.get("default")
    return template or None


def renders_chatml(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether prompts for this tokenizer are ChatML: its template writes ``<|im_start|>``, or it has no template
    (then ``lavis_ds.models.prompt`` writes ChatML itself, as for Qwen2 tokenizers saved without one)."""
    template = template_text(tokenizer)
    return template is None or "<|im_start|>" in template


def unstable_render(tokenizer: PreTrainedTokenizerBase, variables: Mapping[str, Any]) -> str | None:
    """Why the template would render one sample differently on another day (None: it would not)."""
    template = template_text(tokenizer) or ""
    if "strftime_now" in template and "date_string" not in variables:
        return ("the chat template writes today's date into every prompt (Llama 3.2 does): the same sample gives "
                "other tokens tomorrow; set model.chat_template_kwargs.date_string (the Llama presets do)")
    return None


def takes_system_message(tokenizer: PreTrainedTokenizerBase, variables: Mapping[str, Any]) -> bool:
    """Whether the tokenizer's chat template writes a system message it is given: Gemma 2's raises on one, and a
    template that drops it takes none either (a probe conversation rendered once)."""
    probe = "lavis_ds system probe"
    messages = [{"role": "system", "content": probe}, {"role": "user", "content": "Hi"}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **variables)
    except TemplateError:
        return False
    return probe in text


def check_turns(instructions: Sequence[str], answers: Sequence[str], add_generation_prompt: bool) -> int:
    """How many turns keep their answer: training needs one answer per instruction, generation all but the last
    (a reference answer for the last turn, if given, is ignored)."""
    history = len(instructions) - 1 if add_generation_prompt else len(instructions)
    if len(answers) < history or (not add_generation_prompt and len(answers) != len(instructions)):
        raise ValueError(f"{len(instructions)} instruction turn(s) but {len(answers)} answer(s): "
                         "each instruction needs its answer (generation may leave out the last one)")
    return history


@dataclass(frozen=True)
class ChatTemplate:
    """A conversation rendered by ``tokenizer``'s chat template, cut into supervised and context pieces.

    Attributes:
        tokenizer: A tokenizer with a chat template.
        system_prompt: Text of the system message; None sends none (for templates without a system role).
        variables: Extra template variables, e.g. ``enable_thinking: false`` (Qwen3) or ``date_string`` (Llama 3).
    """

    tokenizer: PreTrainedTokenizerBase
    system_prompt: str | None
    variables: Mapping[str, Any] = field(default_factory=dict)

    def segments(self, instructions: Sequence[str], answers: Sequence[str],
                 add_generation_prompt: bool = False) -> Segments:
        """The conversation as ``(text, supervised)`` pieces; with ``add_generation_prompt`` it ends with the
        assistant header of the last turn; its earlier turns keep their answers, marked supervised as in training, so
        that both cut the text alike."""
        history = check_turns(instructions, answers, add_generation_prompt)
        messages = self.messages(instructions, answers[:history])
        text = self.render(messages, add_generation_prompt)
        if GENERATION_BLOCK.search(self._template):
            spans = self._generation_spans(messages, add_generation_prompt)
        else:
            spans = [self._answer_span(messages, i, text) for i, m in enumerate(messages) if m["role"] == "assistant"]
        return _cut(text, spans)

    def messages(self, instructions: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
        """System (if any), then user and assistant messages in turn order."""
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        for i, instruction in enumerate(instructions):
            messages.append({"role": "user", "content": instruction})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        return messages

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **self.variables)
        except TemplateError as e:
            hint = ("; for a template without a system role, set model.system_prompt: null"
                    if self.system_prompt is not None and "system" in str(e).lower() else "")
            raise ChatTemplateError(f"the chat template of {self._name} refused the conversation: {e}{hint}") from e
        except Exception as e:  # Python failing inside the template (a loop over `tools`, which is None): name the line
            line = _template_line(e, self._template)
            if line is None:
                raise
            raise ChatTemplateError(f"the chat template of {self._name} fails at its line {line[0]} ({line[1]!r}): "
                                    f"{type(e).__name__}: {e}; fix the template in the tokenizer folder "
                                    "(tokenizer_config.json or chat_template.jinja)") from None

    def end_of_turn_id(self) -> int:
        """The token that closes an assistant turn (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``): the last
        added token of a probe answer's supervised span. Generation stops at it."""
        pieces = self.segments(["Hi"], ["Hello"])
        ids = [i for text, supervised in pieces if supervised
               for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        added = set(self.tokenizer.added_tokens_decoder)
        marked = [i for i in ids if i in added]
        if not ids:
            raise ChatTemplateError(f"the chat template of {self._name} supervises nothing of an answer")
        return marked[-1] if marked else ids[-1]

    # ------------------------------------------------------------------ the two ways to the mask
    def _answer_span(self, messages: list[dict[str, str]], i: int, text: str) -> tuple[int, int]:
        """Where message ``i`` (an assistant turn) puts its answer in ``text``, a render of ``messages``."""
        what = f"the answer of turn {sum(m['role'] == 'assistant' for m in messages[:i]) + 1}"
        before = self.render(messages[:i])
        header = self._added(before, self.render(messages[:i], True), f"adding the generation prompt before {what}")
        turn = self._added(before, self.render(messages[:i + 1]), f"adding {what}")
        if not turn.startswith(header):
            raise ChatTemplateError(f"the chat template of {self._name} starts {what} with "
                                    f"{turn[:len(header) + 20]!r}, not with its generation prompt {header!r}")
        answer = turn[len(header):].rstrip()
        if not answer:
            raise ChatTemplateError(f"the chat template of {self._name} writes nothing for {what}")
        if not text.startswith(before):
            raise ChatTemplateError(f"the chat template of {self._name} renders the messages before {what} "
                                    "differently once later messages follow")
        span = _locate(text, len(before), header, answer)
        if span is not None:
            return span
        raise ChatTemplateError(f"the chat template of {self._name} renders {what} in the whole "
                                f"conversation as {text[len(before):len(before) + len(header + answer) + 20]!r}, "
                                f"not as its generation prompt {header!r} followed by {answer!r}")

    def _added(self, prefix: str, longer: str, what: str) -> str:
        """What ``longer`` adds to ``prefix``; it must extend it (the prefix property the mask relies on)."""
        if not longer.startswith(prefix):
            raise ChatTemplateError(f"the chat template of {self._name} breaks the prefix property: {what} changes "
                                    f"the text before it, so the answer tokens cannot be told apart exactly "
                                    f"(rendered {prefix[-40:]!r} -> {longer[max(0, len(prefix) - 40):][:80]!r})")
        return longer[len(prefix):]

    def _generation_spans(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[tuple[int, int]]:
        # apply_chat_template reports {% generation %} blocks only as a token mask over one whole-text encoding;
        # the character spans it computes that mask from keep the piece-by-piece tokenization of the other path.
        from transformers.utils.chat_template_utils import render_jinja_template

        _, spans = render_jinja_template(conversations=[messages], chat_template=self._template,
                                         return_assistant_tokens_mask=True, add_generation_prompt=add_generation_prompt,
                                         **{**self.tokenizer.special_tokens_map, **self.variables})
        return [tuple(span) for span in spans[0]]

    @property
    def _template(self) -> str:
        template = template_text(self.tokenizer)
        if template is None:
            raise ChatTemplateError(f"{self._name} has no chat template")
        return template

    @property
    def _name(self) -> str:
        return repr(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__)


def _template_line(error: BaseException, template: str) -> tuple[int, str] | None:
    """(line number, text) of the template line that raised ``error``, or None if the template did not raise it
    (jinja2 rewrites a template's frames to its own lines, under the file name ``<template>``)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == "<template>"]
    if not frames:
        return None
    number = frames[-1].lineno
    lines = template.splitlines()
    return number, (lines[number - 1].strip() if 0 < number <= len(lines) else "")


def _locate(text: str, position: int, header: str, answer: str) -> tuple[int, int] | None:
    """The span of ``answer`` (or of its last lines) after the longest prefix of ``header`` at ``position``."""
    matched = next(end for end in range(len(header), -1, -1) if text.startswith(header[:end], position))
    skips = (0, *(i + 1 for i, char in enumerate(answer) if char == "\n"))
    for end in range(matched, -1, -1):  # the header as far as it stands there, first
        start = position + end
        # The whole answer first; then without leading lines, which templates drop from history turns (reasoning).
        for skip in skips:
            if text.startswith(answer[skip:], start):
                return start, start + len(answer) - skip
    return None


def _cut(text: str, spans: list[tuple[int, int]]) -> Segments:
    """``text`` as ``(piece, supervised)``: the spans supervised, the text between them not; empty pieces dropped."""
    pieces, position = [], 0
    for start, end in sorted(spans):
        pieces += [(text[position:start], False), (text[start:end], True)]
        position = end
    pieces.append((text[position:], False))
    return [(piece, supervised) for piece, supervised in pieces if piece]
