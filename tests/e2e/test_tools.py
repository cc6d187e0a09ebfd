"""Tool calling through real services, the official openai client and LangChain (issue 30):
`tool_choice` "required" and a named function are enforced by the grammar, so every call
parses and its arguments validate against the function's `parameters`, on a random-weight
checkpoint (with a template that renders tools natively, hermes style) and on the default
model (whose template knows no tools: they are taught in a system message); streamed calls
equal unstreamed ones; a history with calls and tool results is served."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.servers import served_with_template

# a compact Qwen2.5-style template: tools in the system turn, calls as <tool_call> blocks
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML \
tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["a", "b"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _check_calls(message) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    # the tiny tokenizer (512 ids) spends a token per ~2 characters: room for the tools' JSON
    with served_with_template(tmp_path_factory.mktemp("tools"), "llama", HERMES_TEMPLATE, 4096, 512) as served:
        yield served


def test_required_calls_validate_against_their_schemas(native):
    client, model = native
    done = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=300, temperature=0)
    assert done.choices[0].finish_reason == "tool_calls"
    assert {name for name, _ in _check_calls(done.choices[0].message)} <= set(SCHEMAS)


def test_a_named_function_is_the_one_called_once(native):
    client, model = native
    for seed in range(3):
        done = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=200,
                                              tool_choice={"type": "function", "function": {"name": "add"}},
                                              temperature=1.0, seed=seed)
        calls = _check_calls(done.choices[0].message)
        assert [name for name, _ in calls] == ["add"]


def test_streamed_calls_equal_the_unstreamed_ones(native):
    client, model = native
    kw = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300,
          "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0]
    parts: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                p = parts.setdefault(tc.index, {"name": "", "arguments": ""})
                p["name"] += tc.function.name or ""
                p["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [parts[i] for i in sorted(parts)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]


def test_a_history_with_calls_and_results_is_served(native):
    client, model = native
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    done = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    short = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=5, temperature=0)
    assert done.usage.prompt_tokens > short.usage.prompt_tokens + 10  # the call and its result are in the prompt


def test_langchain_bind_tools_and_structured_output(native):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    client, model = native

    class Add(BaseModel):
        """Add two integers."""

        a: int = Field(ge=-100, le=100)
        b: int = Field(ge=-100, le=100)

    llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key="x", temperature=0, max_tokens=200,
                     max_retries=0)
    msg = llm.bind_tools([Add], tool_choice="Add", strict=True).invoke("What is 2 + 3?")
    assert [c["name"] for c in msg.tool_calls] == ["Add"], (msg, msg.invalid_tool_calls)
    assert set(msg.tool_calls[0]["args"]) == {"a", "b"} and all(isinstance(v, int)
                                                               for v in msg.tool_calls[0]["args"].values())

    class City(BaseModel):
        name: str = Field(max_length=16)
        population: int = Field(ge=0, le=10_000_000)

    city = llm.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City)


def test_required_on_the_default_model_whose_template_knows_no_tools(smollm_server):
    client = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=200, temperature=0)
    assert done.choices[0].finish_reason == "tool_calls"
    _check_calls(done.choices[0].message)
