"""A run's chat-template variables as a template's defaults (lavis_ds.models.template_defaults), in-process, on the
published templates in tests/fixtures/chat_templates: the default render is the one with the variables, a caller
still chooses, and what cannot be carried is named."""
from __future__ import annotations

import json

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from families import TEMPLATES
from lavis_ds.models.template_defaults import (NoJinjaLiteral, carried_variables, jinja_literal, settable,
                                              with_defaults)

QWEN3 = (TEMPLATES / "qwen3-0.6b.jinja").read_text()
LLAMA32 = (TEMPLATES / "llama-3.2-3b-instruct.jinja").read_text()
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "What is it?"}]


def render(template: str, **variables) -> str:
    return render_jinja_template([CHAT], chat_template=template, add_generation_prompt=True, **variables)[0][0]


@pytest.mark.parametrize("value", [None, True, False, 0, -3, 2.5, "", 'q"uote\n\\ ünï 😀 {{ x }}', [1, None, "a"],
                                   {"k": [True, {"n": None}], "é": 1.0}])
def test_a_value_reads_back_from_its_jinja_literal(value):
    text = jinja2.Environment().from_string("{%- set v = " + jinja_literal(value) + " -%}{{ v | tojson }}").render()
    assert json.loads(text) == value


@pytest.mark.parametrize("value", [float("nan"), float("inf"), object()])
def test_a_value_without_a_jinja_literal_is_refused(value):
    with pytest.raises(NoJinjaLiteral, match="has no Jinja literal"):
        jinja_literal(value)


@pytest.mark.parametrize("template, variables", [(QWEN3, {"enable_thinking": False}),
                                                 (LLAMA32, {"date_string": "26 Jul 2024"})])
def test_the_default_render_is_the_trained_one_and_a_caller_still_chooses(template, variables):
    defaulted, carried = with_defaults(template, variables)
    assert carried.carried == variables and carried.notes == []
    assert render(defaulted) == render(template, **variables)
    assert render(defaulted) != render(template)  # the variable matters: thinking on, or today's date
    (name, _), = variables.items()
    other = {"enable_thinking": True, "date_string": "01 Jan 2030"}[name]
    assert render(defaulted, **{name: other}) == render(template, **{name: other})


def test_only_the_variables_the_template_reads_are_carried():
    carried = carried_variables(QWEN3, {"enable_thinking": False, "date_string": "26 Jul 2024"})
    assert carried.carried == {"enable_thinking": False} and carried.notes == []


@pytest.mark.parametrize("variables, special, why", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, (), "transformers passes that variable"),
    ({"bos_token": "<s>"}, ("bos_token",), "transformers passes that variable"),
    ({"enable_thinking": float("nan")}, (), "no Jinja literal"),
])
def test_a_variable_the_template_reads_but_cannot_default_to_is_named(variables, special, why):
    template = QWEN3 + "{{ bos_token }}"
    carried = carried_variables(template, variables, special)
    (name, _), = variables.items()
    assert carried.carried == {}
    assert len(carried.notes) == 1 and f"model.chat_template_kwargs.{name}" in carried.notes[0]
    assert why in carried.notes[0] and "pass" in carried.notes[0]


def test_a_prelude_for_any_template_sets_only_what_jinja_can_assign():
    variables = {"enable_thinking": False, "my-flag": True, "tools": [], "ratio": float("nan")}
    prelude = settable(variables).prelude()
    assert settable(variables).carried == {"enable_thinking": False}
    assert render(prelude + QWEN3) == render(QWEN3, enable_thinking=False)
