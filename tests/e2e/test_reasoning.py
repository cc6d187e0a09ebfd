"""A Qwen3-style thinking template through real services (issue 30): the template's own
`enable_thinking` switch reaches it through `chat_template_kwargs`, and with thinking off a
structured-output constraint binds the whole reply, which parses; a prompt that opens the
thinking (DeepSeek-R1 style, here a template variable) sends the reply to
`reasoning_content`, streamed alike; a variable the server sets itself is refused by name."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel, Field

from tests.servers import served_with_template

QWEN3_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == 'assistant' and '</think>' in message.content %}{{ message.content.split('</think>')[-1] }}\
{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif think_first is defined and think_first %}<think>
{% endif %}{% endif %}"""


class Answer(BaseModel):
    value: int = Field(ge=0, le=99)
    sure: bool


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with served_with_template(tmp_path_factory.mktemp("qwen3"), "qwen3", QWEN3_TEMPLATE, 2048, 256) as served:
        yield served


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_constrained(qwen3):
    client, model = qwen3
    ask = [{"role": "user", "content": "What is 6 x 7?"}]
    on = client.chat.completions.create(model=model, messages=ask, max_tokens=1)
    # a random model may indent every gap of the JSON (21 characters at most): room for that
    done = client.chat.completions.parse(model=model, messages=ask, response_format=Answer, max_tokens=240,
                                         temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert done.usage.prompt_tokens > on.usage.prompt_tokens  # the empty thinking block is in the prompt
    message = done.choices[0].message
    assert isinstance(message.parsed, Answer) and done.choices[0].finish_reason == "stop"
    assert getattr(message, "reasoning_content", None) is None


def test_a_reply_inside_opened_thinking_is_reasoning_content(qwen3):
    """A random model never closes its thinking: the whole reply (cut by max_tokens) is
    thinking, none of it content, in the whole reply and in the stream alike."""
    client, model = qwen3
    kw = {"model": model, "messages": [{"role": "user", "content": "Think first."}], "max_tokens": 12,
          "temperature": 0, "extra_body": {"chat_template_kwargs": {"think_first": True}}}
    done = client.chat.completions.create(**kw)
    message = done.choices[0].message
    assert message.reasoning_content and message.content == "" and done.usage.completion_tokens == 12
    thinking = content = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            thinking += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert thinking == message.reasoning_content and content == ""


def test_a_variable_the_server_sets_is_refused(qwen3):
    client, model = qwen3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert info.value.body["param"] == "chat_template_kwargs.add_generation_prompt"
