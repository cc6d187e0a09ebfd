"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through real
services and the official `anthropic` SDK (nobody here wrote it).

Text runs on the default model (the session's SmolLM2-135M-Instruct): greedy replies equal
`/v1/chat/completions` for the same conversation (one chat path, one template), streamed
equals unstreamed, and the raw stream is Anthropic's event sequence. Tools run on a tiny
random Llama with a hermes template that renders tools (served with an API key, so the same
server checks `x-api-key`): a forced call validates against its `input_schema`, and its
result sent back gets an answer. Refusals are Anthropic-shaped 400s naming the field, and
leave no KV page in use (the autouse `pages_back_to_zero` check)."""

from __future__ import annotations

import json
import re
import time
from typing import NamedTuple

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.test_tools import HERMES_TEMPLATE
from tests.servers import MstarServer

KEY = "k-messages"
GREEDY = {"temperature": 0}
SYSTEM = "You are a helpful assistant. Answer in one sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                                         "b": {"type": "integer", "minimum": -100, "maximum": 100}},
                        "required": ["a", "b"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, ADD)}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


@pytest.fixture(scope="module")
def smollm(smollm_server) -> tuple[anthropic.Anthropic, str]:
    model = httpx.get(smollm_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return anthropic.Anthropic(base_url=smollm_server.url, api_key="x", max_retries=0, timeout=60), model


class Keyed(NamedTuple):
    """A server that wants the API key KEY (`/metrics` too, so the autouse page check,
    which sends no key, is done here: `keyed_pages_back_to_zero`)."""

    url: str
    model: str


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A tiny random Llama, hermes tool template, served with API key KEY."""
    folder = tmp_path_factory.mktemp("messages-tools")
    ckpt = make_checkpoint(folder / "tiny-llama", "llama", max_position_embeddings=4096)
    (folder / "template.jinja").write_text(HERMES_TEMPLATE)
    server = MstarServer(str(ckpt), folder / "log.txt", "--num-kv-pages", "512", "--chat-template",
                         str(folder / "template.jinja"), env={"MSTAR_API_KEY": KEY}).start()
    yield Keyed(server.url, ckpt.name)
    server.stop()


def _pages_used(url: str) -> float | None:
    """The KV pages in use (None: the pools are not published yet)."""
    r = httpx.get(url + "/metrics", headers={"x-api-key": KEY}, timeout=5)
    assert r.status_code == 200
    values = re.findall(r"^mstar_kv_pages_used(?:\{[^}]*\})? ([0-9.eE+-]+)$", r.text, re.M)
    return sum(float(v) for v in values) if values else None


@pytest.fixture(autouse=True)
def keyed_pages_back_to_zero(request):
    yield
    if "tool_server" in request.fixturenames:
        url = request.getfixturevalue("tool_server").url
        deadline = time.monotonic() + 5
        while _pages_used(url) != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pages_used(url) == 0, "KV pages left in use after the test"


def _client(server: Keyed, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


@pytest.fixture(scope="module")
def greedy(smollm):
    """The greedy reply to SYSTEM + ASK (48 tokens at most), from /v1/messages."""
    client, model = smollm
    return client.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=48, extra_body=GREEDY)


# ---- text (the default model) --------------------------------------------------------------------


def test_create_equals_chat_completions(smollm_server, smollm, greedy):
    _, model = smollm
    chat = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=48, temperature=0)
    assert greedy.id.startswith("msg_") and greedy.type == "message" and greedy.role == "assistant"
    assert greedy.model == model
    assert [b.type for b in greedy.content] == ["text"]
    assert greedy.content[0].text == chat.choices[0].message.content and greedy.content[0].text
    assert greedy.stop_reason == STOP_REASONS[chat.choices[0].finish_reason] and greedy.stop_sequence is None
    assert greedy.usage.input_tokens == chat.usage.prompt_tokens
    assert greedy.usage.output_tokens == chat.usage.completion_tokens


def test_stream_equals_create(smollm_server, smollm, greedy):
    client, model = smollm
    with client.messages.stream(model=model, system=SYSTEM, messages=ASK, max_tokens=48, extra_body=GREEDY) as s:
        deltas = [e.delta.text for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "".join(deltas) == _text(final) == _text(greedy)
    assert len(deltas) > 1
    assert final.stop_reason == greedy.stop_reason
    assert final.usage.input_tokens == greedy.usage.input_tokens
    assert final.usage.output_tokens == greedy.usage.output_tokens


def test_raw_stream_is_anthropics_event_sequence(smollm_server, smollm, greedy):
    _, model = smollm
    body = {"model": model, "system": SYSTEM, "messages": ASK, "max_tokens": 48, "stream": True, **GREEDY}
    with httpx.stream("POST", smollm_server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [(lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: ")))
              for lines in (block.split("\n") for block in raw.strip().split("\n\n"))]
    assert all(kind == data["type"] for kind, data in events)
    kinds = [kind for kind, _ in events]
    n = len(kinds) - 6
    assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * n,
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": greedy.usage.input_tokens, "output_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for _, d in events[3:3 + n]) == _text(greedy)
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": greedy.stop_reason,
                                                                "stop_sequence": None},
                             "usage": {"input_tokens": greedy.usage.input_tokens,
                                       "output_tokens": greedy.usage.output_tokens}}


def test_count_tokens_is_the_prompt_create_reported(smollm, greedy):
    client, model = smollm
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == greedy.usage.input_tokens


def test_stop_sequence(smollm_server, smollm, greedy):
    client, model = smollm
    full = _text(greedy)
    stop = full.split()[2]  # a word inside the reply
    done = client.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=48, stop_sequences=[stop],
                                  extra_body=GREEDY)
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == stop
    assert _text(done) == full[:full.find(stop)]


def test_max_tokens(smollm_server, smollm, greedy):
    client, model = smollm
    done = client.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=3, extra_body=GREEDY)
    assert done.stop_reason == "max_tokens" and done.stop_sequence is None
    assert done.usage.output_tokens == 3
    assert _text(greedy).startswith(_text(done))


def test_prefill_is_continued(smollm_server, smollm):
    """A final assistant turn is continued: the reply equals /v1/completions on the prompt
    /tokenize renders with continue_final_message (transformers' cut after its content)."""
    client, model = smollm
    prefill = "The capital of France is"
    messages = [*ASK, {"role": "assistant", "content": prefill}]
    done = client.messages.create(model=model, system=SYSTEM, messages=messages, max_tokens=12, extra_body=GREEDY)
    chat = [{"role": "system", "content": SYSTEM}, *messages]
    ids = httpx.post(smollm_server.url + "/tokenize", json={"messages": chat, "add_generation_prompt": False,
                                                            "continue_final_message": True}, timeout=10).json()
    assert done.usage.input_tokens == ids["count"]
    assert client.messages.count_tokens(model=model, system=SYSTEM, messages=messages).input_tokens == ids["count"]
    completion = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model=model, prompt=ids["tokens"], max_tokens=12, temperature=0)
    assert _text(done) == completion.choices[0].text and _text(done)
    assert done.stop_reason == STOP_REASONS[completion.choices[0].finish_reason]


@pytest.mark.parametrize(("messages", "extra", "field"), [
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "4"}]}], {},
     "messages.0.content.0.tool_use_id"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "document", "source": {}}]}], {},
     "messages.0.content.1.type"),
    ([{"role": "user", "content": [{"type": "text", "txt": "hi"}]}], {}, "messages.0.content.0"),
    (ASK, {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}]},
     "tools.0.input_schema"),
    (ASK, {"tool_choice": {"type": "tool", "name": "missing"}, "tools": [WEATHER]}, "tool_choice.name"),
    (ASK, {"temperature": 1.5}, "temperature"),
])
def test_bad_input_is_an_anthropic_400_naming_the_field(smollm_server, smollm, messages, extra, field):
    client, model = smollm
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, messages=messages, max_tokens=4, extra_body=extra)
    assert info.value.status_code == 400
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(field), body


def test_missing_max_tokens_and_unknown_model(smollm_server, smollm):
    client, model = smollm
    r = httpx.post(smollm_server.url + "/v1/messages", json={"model": model, "messages": ASK}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens is required: an integer >= 1"}}
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", messages=ASK, max_tokens=4)
    assert info.value.body["error"]["type"] == "not_found_error"


# ---- tools (tiny random Llama, hermes template; served with an API key) -------------------------


def test_forced_tool_round_trip(tool_server):
    client = _client(tool_server)
    kw = {"model": tool_server.model, "tools": [WEATHER, ADD], "max_tokens": 200, "extra_body": GREEDY}
    first = client.messages.create(messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert [c.name for c in calls] == ["get_weather"] and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, SCHEMAS["get_weather"])
    history = [*ASK, {"role": "assistant", "content": first.content},  # the SDK's own blocks, sent back
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                             "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    second = client.messages.create(messages=history, tool_choice={"type": "none"}, **{**kw, "max_tokens": 8})
    assert second.stop_reason in ("end_turn", "max_tokens") and [b.type for b in second.content] == ["text"]
    counted = client.messages.count_tokens(model=tool_server.model, messages=history, tools=[WEATHER, ADD],
                                           tool_choice={"type": "none"})
    assert second.usage.input_tokens == counted.input_tokens


def test_streamed_tool_use_equals_the_unstreamed(tool_server):
    client = _client(tool_server)
    kw = {"model": tool_server.model, "messages": ASK, "tools": [WEATHER, ADD], "max_tokens": 200,
          "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "extra_body": GREEDY}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in whole.content] == [(b.name, b.input) for b in final.content]
    assert len(whole.content) == 1
    jsonschema.validate(whole.content[0].input, SCHEMAS[whole.content[0].name])


def test_tool_history_renders_as_chat_completions(tool_server):
    """count_tokens of a conversation with a call and its result equals the chat route's
    prompt for the same conversation in OpenAI's form (the translation is exact)."""
    args = {"city": "Paris", "unit": "celsius"}
    messages = [*ASK, {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                             {"type": "text", "text": "Thanks!"}]}]
    counted = _client(tool_server).messages.count_tokens(model=tool_server.model, system=SYSTEM, messages=messages,
                                                         tools=[WEATHER])
    chat = openai.OpenAI(base_url=tool_server.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=tool_server.model, max_tokens=1, tools=[{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        messages=[{"role": "system", "content": SYSTEM}, *ASK,
                  {"role": "assistant", "content": "Let me look.", "tool_calls": [
                      {"id": "toolu_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
                  {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
                  {"role": "user", "content": "Thanks!"}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_x_api_key(tool_server):
    ok = _client(tool_server).messages.create(model=tool_server.model, messages=ASK, max_tokens=2, extra_body=GREEDY)
    assert ok.usage.output_tokens <= 2
    with pytest.raises(anthropic.AuthenticationError) as info:
        _client(tool_server, "wrong").messages.create(model=tool_server.model, messages=ASK, max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
    body = {"model": tool_server.model, "messages": ASK, "max_tokens": 1}
    bearer = httpx.post(tool_server.url + "/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    missing = httpx.post(tool_server.url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
