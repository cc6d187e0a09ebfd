"""Anthropic's Messages dialect in-process, without peers: a body's translation into the
chat path's request and messages, the refusals (Anthropic's shape, Messages field names),
the `message` object and the exact event stream built from delta / done events, the
count_tokens route, and `x-api-key`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.api.app import create_app
from services.api.dialects.messages.errors import error_body
from services.api.dialects.messages.reply import MessagesReply
from services.api.dialects.messages.schemas import MessagesCountTokensRequest, MessagesRequest
from services.api.dialects.messages.translate import Translated, translate
from services.api.errors import ApiError, HttpKind
from services.api.events import DeltaEvent, DoneEvent, Usage, encode
from services.api.validation import load
from shared.errors import ErrorKind
from shared.model_source import TokenizerBundle
from tests.checkpoints import CHAT_TEMPLATE
from tests.unit.test_api_openai import make_settings

MODEL = "test-model"
THINKING_TEMPLATE = CHAT_TEMPLATE + "{% if add_generation_prompt %}<think>\n{% endif %}{# </think> #}"
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "The weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "messages": USER, **kw}


def parsed(obj: dict[str, Any], template: str | None = CHAT_TEMPLATE, vision: bool = False,
           cls: type[MessagesRequest] | type[MessagesCountTokensRequest] = MessagesRequest) -> Translated:
    return translate(load(obj, cls), MODEL, template, vision)


def refused(obj: dict[str, Any], template: str | None = CHAT_TEMPLATE, vision: bool = False) -> str:
    """The Anthropic error message of a refused body."""
    with pytest.raises(ApiError) as info:
        parsed(obj, template, vision)
    out = error_body(info.value)
    assert out.error.type == "invalid_request_error" and info.value.status == 400
    return out.error.message


# ---- translation -----------------------------------------------------------------------------------


def test_sampling_stop_and_ids() -> None:
    t = parsed(body(temperature=0, top_p=0.5, top_k=7, stop_sequences=["a", "b", "a"], stream=True,
                    metadata={"user_id": "u"}, service_tier="auto"))
    p = t.req.params
    assert (p.sampling.temperature, p.sampling.top_p, p.sampling.top_k) == (0.0, 0.5, 7)
    assert p.stop == ["a", "b"] and p.max_tokens == 16 and not p.add_special_tokens
    assert p.request_id.startswith("msg_") and t.req.stream and p.stream and t.req.tools is None
    assert t.messages == [{"role": "user", "content": "hi"}]
    assert p.defaulted == {"min_p", "repetition_penalty"}  # generation_config.json may fill them
    left = parsed(body()).req.params
    assert (left.sampling.temperature, left.sampling.top_p, left.sampling.top_k) == (1.0, 1.0, 0)
    assert left.defaulted == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}


def test_system_text_blocks_and_tool_history() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "text", "text": "calling", "citations": None},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}, "caller": None}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sun"}]},
            {"type": "text", "text": "and?"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "oops", "is_error": True}]},
    ]
    t = parsed(body(system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2",
                                                              "cache_control": {"type": "ephemeral"}}],
                    messages=messages))
    assert t.messages == [
        {"role": "system", "content": "S1\nS2"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sun", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "and?"},
        {"role": "tool", "content": "Error: oops", "tool_call_id": "toolu_1"},
    ]


def test_a_final_assistant_turn_is_a_prefill() -> None:
    t = parsed(body(messages=[*USER, {"role": "assistant", "content": [{"type": "text", "text": "The"},
                                                                       {"type": "text", "text": "answer is"}]}]))
    assert t.messages == [{"role": "user", "content": "hi"}] and t.prefill == "The\nanswer is"
    assert parsed(body()).prefill == ""


def test_images_on_a_vision_model_are_data_urls_in_order() -> None:
    content = [{"type": "text", "text": "what?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}},
               {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]
    t = parsed(body(system="S", messages=[{"role": "user", "content": content}]), vision=True)
    assert t.messages == [{"role": "system", "content": [{"type": "text", "text": "S"}]},
                          {"role": "user", "content": [{"type": "text", "text": "what?"}, {"type": "image"},
                                                       {"type": "image"}]}]
    assert [(r.url, r.param) for r in t.req.params.image_refs] == [
        ("data:image/png;base64,QUJD", "messages.0.content.1.source.data"),
        ("https://example.com/a.png", "messages.0.content.2.source.url")]
    assert refused(body(messages=[{"role": "user", "content": content}])) == (
        "messages.0.content.1: the served model takes no images")


def test_tool_choice_mapping() -> None:
    tools = [WEATHER, {**WEATHER, "name": "other"}]
    auto = parsed(body(tools=tools)).req.tools
    assert auto is not None and auto.choice == "auto" and auto.parallel
    assert auto.tools[0] == {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                              "parameters": WEATHER["input_schema"]}}
    any_ = parsed(body(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})).req.tools
    assert any_ is not None and any_.choice == "required" and not any_.parallel and any_.forced
    named = parsed(body(tools=tools, tool_choice={"type": "tool", "name": "other"})).req.tools
    assert named is not None and named.choice == "named" and named.name == "other" and len(named.tools) == 1
    assert parsed(body(tools=tools, tool_choice={"type": "none"})).req.tools is None
    assert parsed(body(tool_choice={"type": "none"})).req.tools is None


def test_thinking() -> None:
    assert parsed(body(thinking={"type": "disabled"})).req.template_kwargs == {}
    assert parsed(body(thinking={"type": "disabled"}), THINKING_TEMPLATE).req.template_kwargs == {
        "enable_thinking": False}
    on = body(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 1024})
    assert parsed(on, THINKING_TEMPLATE).req.template_kwargs == {"enable_thinking": True}
    assert refused(on).startswith('thinking: {"type": "enabled"} needs a reasoning model')
    assert refused({**on, "max_tokens": 1024}, THINKING_TEMPLATE) == (
        "thinking.budget_tokens (1024) must be less than max_tokens (1024)")
    assert refused(body(thinking={"type": "enabled", "budget_tokens": 10})) == (
        "thinking.budget_tokens must be an integer >= 1024, got 10")


@pytest.mark.parametrize(("obj", "message"), [
    ({"model": MODEL, "messages": USER}, "max_tokens is required: an integer >= 1"),
    (body(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (body(messages=[]), "messages must be a non-empty list of messages, got []"),
    (body(messages=[{"role": "system", "content": "x"}]),
     'messages.0.role must be one of user, assistant, got "system"'),
    (body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     'messages.0.content.0.type must be one of text, image, tool_use, tool_result, thinking, got "document"'),
    (body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages.0.content.0.text is required: a string"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]),
     "messages.0.content.0.citations must be null (a reply block's field, sent back unchanged), got [{}]"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]),
     'messages.0.content.0.tool_use_id: "toolu_9" answers no tool_use block of an earlier assistant message'),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "messages.0.content.0.type: a tool_use block is not allowed in a user message"),
    (body(messages=[*USER, {"role": "assistant", "content": "The answer is "}]),
     "messages.1: final assistant content cannot end with trailing whitespace"),
    (body(messages=[*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "messages.1.content.0.type: a final assistant message (a prefill) holds text only, not a tool_use block"),
    (body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "x"}}]}]),
     'messages.0.content.0.source.media_type must be image/jpeg, image/png, image/gif or image/webp, got "image/tiff"'),
    (body(tools=[{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}]),
     "tools.0.input_schema does not compile: Invalid type: nope"),
    (body(tools=[{"name": "f", "input_schema": {"type": "array"}}]),
     'tools.0.input_schema.type must be "object", got "array"'),
    (body(tools=[{"name": "f f", "input_schema": {"type": "object"}}]),
     'tools.0.name must be 1-64 characters of [A-Za-z0-9_.-], got "f f"'),
    (body(tools=[WEATHER, WEATHER]), 'tools.1.name: the tool name "get_weather" is used twice'),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     'tools.0.type must be one of custom, got "web_search_20250305"'),
    (body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
     'tool_choice.name: "nope" is not a tool (get_weather)'),
    (body(tool_choice={"type": "any"}), 'tool_choice {"type": "any"} needs tools'),
    (body(temperature=1.5), "temperature must be a number in [0, 1] (0 = greedy), got 1.5"),
    (body(stop_sequences=[""]), 'stop_sequences.0 must be a non-empty string, got ""'),
    (body(top_k=-1), "top_k must be an integer >= 0 (0 = off), got -1"),
])
def test_refusals_name_messages_fields(obj: dict[str, Any], message: str) -> None:
    assert refused(obj) == message


def test_unknown_field_and_model() -> None:
    assert refused(body(n=2)).startswith("unknown field 'n'; allowed fields: max_tokens, messages, metadata, model")
    with pytest.raises(ApiError) as info:
        parsed(body(model="claude-x"))
    assert info.value.status == 404 and error_body(info.value).error.type == "not_found_error"


# ---- errors ------------------------------------------------------------------------------------------


def test_error_bodies() -> None:
    def shape(err: ApiError) -> dict[str, Any]:
        return json.loads(encode(error_body(err)))

    assert shape(ApiError(ErrorKind.TOO_LONG, "prompt is 9 tokens; it exceeds max_seq_len 8", "prompt")) == {
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "messages: prompt is 9 tokens; it exceeds max_seq_len 8"}}
    assert shape(ApiError(ErrorKind.INVALID, "messages[0].content[1] is bad", "messages[0].content[1]")) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "messages.0.content.1 is bad"}}
    assert shape(ApiError(ErrorKind.INTERNAL, "internal error", error_id="e1")) == {
        "type": "error", "error": {"type": "api_error", "message": "internal error (error id e1)"}}
    kinds = {ErrorKind.UNAVAILABLE: "overloaded_error", HttpKind.UNAUTHORIZED: "authentication_error",
             HttpKind.TOO_LARGE: "request_too_large", HttpKind.RATE_LIMITED: "rate_limit_error",
             ErrorKind.CONFLICT: "invalid_request_error", ErrorKind.WORKER_FAILED: "api_error"}
    for kind, name in kinds.items():
        assert error_body(ApiError(kind, "m")).error.type == name


# ---- replies -----------------------------------------------------------------------------------------


def done(text: str, finish: str = "stop", stop_reason: str | None = None) -> DoneEvent:
    event = DoneEvent("msg_1", text, [1] * 5, finish, Usage(7, 5))
    if stop_reason is not None:
        event.stop_reason = stop_reason
    return event


def delta(text: str) -> DeltaEvent:
    return DeltaEvent("msg_1", text, [1])


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Each event's (event line, data object); the two name the same type."""
    out = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data.removeprefix("data: "))
        assert obj["type"] == kind.removeprefix("event: ")
        out.append((obj["type"], obj))
    return out


HEAD = [("message_start", {"type": "message_start", "message": {
    "type": "message", "id": "msg_1", "model": "m", "content": [], "stop_reason": None, "stop_sequence": None,
    "usage": {"input_tokens": 7, "output_tokens": 0}, "role": "assistant"}}), ("ping", {"type": "ping"})]


def tail(reason: str, sequence: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    return [("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": {"input_tokens": 7, "output_tokens": 5}}),
            ("message_stop", {"type": "message_stop"})]


def block(kind: str, index: int, **start: Any) -> tuple[str, dict[str, Any]]:
    return ("content_block_" + kind, {"type": "content_block_" + kind, "index": index, **start})


def text_delta(index: int, text: str) -> tuple[str, dict[str, Any]]:
    return block("delta", index, delta={"type": "text_delta", "text": text})


def test_json_reply_stop_reasons() -> None:
    reply = MessagesReply("msg_1", "m")
    assert json.loads(encode(reply.json(done("Paris.")))) == {
        "type": "message", "id": "msg_1", "model": "m", "content": [{"type": "text", "text": "Paris."}],
        "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 5},
        "role": "assistant"}
    out = reply.json(done("Par", "stop", "is"))
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", "is")
    assert reply.json(done("Pa", "length")).stop_reason == "max_tokens"
    assert reply.json(done("", "abort")).content == [] and reply.json(done("", "abort")).stop_reason == "end_turn"


def test_text_stream() -> None:
    reply = MessagesReply("msg_1", "m", input_tokens=7)
    raw = reply.event(delta("Par")) + reply.event(delta("")) + reply.event(delta("is")) + reply.event(
        done("Paris", "stop", "."))
    assert sse(raw) == [*HEAD, block("start", 0, content_block={"type": "text", "text": ""}),
                        text_delta(0, "Par"), text_delta(0, "is"), block("stop", 0), *tail("stop_sequence", ".")]
    assert reply.end() == b""


def test_tool_calls_json_and_stream() -> None:
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = MessagesReply("msg_1", "m", tool_format="hermes").json(done(text))
    assert whole.stop_reason == "tool_use"
    assert [type(b).__name__ for b in whole.content] == ["MessagesTextBlock", "MessagesToolUseBlock"]
    call = whole.content[1]
    assert call.id.startswith("toolu_") and (call.name, call.input) == ("get_weather", {"city": "Oslo"})

    reply = MessagesReply("msg_1", "m", input_tokens=7, tool_format="hermes")
    raw = b"".join(reply.event(delta(text[i:i + 7])) for i in range(0, len(text), 7)) + reply.event(done(text))
    events = sse(raw)
    use = events[-5][1]["content_block"]
    assert use["id"].startswith("toolu_")
    texts = "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta" and e["index"] == 0)
    assert texts == "Sure."
    assert [k for k, _ in events if k != "content_block_delta"] == [
        "message_start", "ping", "content_block_start", "content_block_stop", "content_block_start",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[-5:] == [
        block("start", 1, content_block={"type": "tool_use", "id": use["id"], "name": "get_weather", "input": {}}),
        block("delta", 1, delta={"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}),
        block("stop", 1), *tail("tool_use")]


def test_reasoning_json_and_stream() -> None:
    text = "Let me see</think>\n\nParis"
    whole = MessagesReply("msg_1", "m", reasoning="open").json(done(text))
    assert json.loads(encode(whole))["content"] == [{"type": "thinking", "thinking": "Let me see", "signature": ""},
                                                    {"type": "text", "text": "Paris"}]
    reply = MessagesReply("msg_1", "m", input_tokens=7, reasoning="open")
    raw = reply.event(delta("Let me")) + reply.event(delta(" see</th")) + reply.event(delta("ink>\n\nPar"))
    raw += reply.event(delta("is")) + reply.event(done(text))
    thinking = {"type": "thinking_delta"}
    assert sse(raw) == [
        *HEAD, block("start", 0, content_block={"type": "thinking", "thinking": "", "signature": ""}),
        block("delta", 0, delta={**thinking, "thinking": "Let me"}),
        block("delta", 0, delta={**thinking, "thinking": " see"}),
        block("delta", 0, delta={"type": "signature_delta", "signature": ""}), block("stop", 0),
        block("start", 1, content_block={"type": "text", "text": ""}), text_delta(1, "Par"), text_delta(1, "is"),
        block("stop", 1), *tail("end_turn")]


def test_error_event() -> None:
    raw = MessagesReply("msg_1", "m").error(ApiError(ErrorKind.WORKER_FAILED, "worker failed"))
    assert sse(raw) == [("error", {"type": "error", "error": {"type": "api_error", "message": "worker failed"}})]


# ---- routes in-process -------------------------------------------------------------------------------


def byte_tokenizer() -> Tokenizer:
    """One token per byte: a count that is exactly the rendered prompt's length in bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    t = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t


@pytest.fixture()
def client(tmp_path):
    bundle = TokenizerBundle(byte_tokenizer(), CHAT_TEMPLATE, [0])
    with TestClient(create_app(make_settings(tmp_path, api_key="k"), bundle)) as c:
        yield c


def test_count_tokens_is_the_chat_prompt(client: TestClient) -> None:
    r = client.post("/v1/messages/count_tokens", json={"model": MODEL, "system": "S", "messages": USER},
                    headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    prompt = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert r.status_code == 200 and r.json() == {"input_tokens": len(prompt)}
    tokenized = client.post("/tokenize", json={"messages": [{"role": "system", "content": "S"}, *USER]},
                            headers={"Authorization": "Bearer k"})
    assert tokenized.json()["count"] == len(prompt)
    r = client.post("/v1/messages/count_tokens", json=body(), headers={"x-api-key": "k"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("unknown field 'max_tokens'")


def test_route_refusals_are_anthropic_shaped(client: TestClient) -> None:
    r = client.post("/v1/messages", json=body(messages=[{"role": "user", "content": [{"type": "nope"}]}]),
                    headers={"x-api-key": "k"})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": 'messages.0.content.0.type must be one of text, image, tool_use, tool_result, thinking, got "nope"'}}
    r = client.post("/v1/messages", content=b"{", headers={"x-api-key": "k"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("request body is not valid JSON")


def test_api_key_headers(client: TestClient) -> None:
    missing = client.post("/v1/messages", json=body())
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json() == {"type": "error", "error": {
        "type": "authentication_error",
        "message": "missing API key: send the header x-api-key: <key>"}}
    wrong = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER},
                        headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"] == {"type": "authentication_error",
                                                                  "message": "invalid API key"}
    assert client.get("/v1/models", headers={"x-api-key": "nope"}).json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope", "x-api-key": "k"}).status_code == 200


def test_openapi_lists_the_routes(client: TestClient) -> None:
    doc = client.get("/openapi.json", headers={"x-api-key": "k"}).json()
    post = doc["paths"]["/v1/messages"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/MessagesRequest"}
    assert post["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/MessagesResponse"}
    assert set(doc["components"]["schemas"]["MessagesRequest"]["required"]) == {"model", "messages", "max_tokens"}
    assert "/v1/messages/count_tokens" in doc["paths"]
