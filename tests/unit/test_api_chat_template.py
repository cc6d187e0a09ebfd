"""ChatTemplate renders exactly what transformers' apply_chat_template renders, and turns a
template's raise_exception into a 400 naming `messages`."""

from __future__ import annotations

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from services.api.chat_template import ChatTemplate
from services.api.errors import ApiError
from tests.checkpoints import CHAT_TEMPLATE

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.index0 == 0 and message['role'] != 'system' %}"
    "{{ raise_exception('first message must be system') }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Block tags on their own lines: trim_blocks / lstrip_blocks decide the whitespace.
BLOCKY = """{% for message in messages %}
    {% if message.role == 'assistant' %}
        {% generation %}
A: {{ message.content }}{{ eos_token }}
        {% endgeneration %}
    {% else %}
{{ message.role | upper }}: {{ message.content }} {{ message | tojson }}
    {% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}
count={{ ns.n }}{% if bos_token is defined %} bos={{ bos_token }}{% endif %}
{% if add_generation_prompt %}A:{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief. \"quoted\" <html> & ünïcode 🎉"},
    {"role": "user", "content": "Hi there  "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again", "name": "bob"},
    {"role": "user", "content": "past the break"},
]


def hf_render(template: str, messages: list[dict], **specials: str) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True,
                                        **specials)
    return rendered[0]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA3, BLOCKY], ids=["chatml", "llama3", "blocks"])
@pytest.mark.parametrize("specials", [{}, {"bos_token": "<s>", "eos_token": "</s>"}, {"eos_token": "<|im_end|>"}])
def test_matches_transformers(template: str, specials: dict[str, str]) -> None:
    ours = ChatTemplate(template, specials.get("bos_token"), specials.get("eos_token")).render(MESSAGES)
    assert ours == hf_render(template, MESSAGES, **specials)


def test_raise_exception_is_a_400() -> None:
    with pytest.raises(ApiError) as info:
        ChatTemplate(LLAMA3, "<s>").render([{"role": "user", "content": "hi"}])
    err = info.value
    assert (err.status, err.param, err.message) == (
        400, "messages", "the model's chat template refused these messages: first message must be system")


def test_sandbox_refuses_unsafe_access() -> None:
    with pytest.raises(ApiError) as info:
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    assert info.value.status == 400  # a SecurityError is a TemplateError: the template, not a crash

    with pytest.raises(ApiError) as info:
        ChatTemplate("{% set x = messages.append(1) %}").render([{"role": "user", "content": "x"}])
    assert info.value.status == 400  # immutable: templates cannot change the messages


def test_broken_template_is_a_500_with_error_id() -> None:
    t = ChatTemplate("{% for m in messages %}")  # never closed
    with pytest.raises(ApiError) as info:
        t.render([{"role": "user", "content": "x"}])
    assert info.value.status == 500 and info.value.error_id and info.value.message == "internal error"
