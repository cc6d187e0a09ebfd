"""The Responses dialect without servers: a body's translation into chat messages and a chat
body, refusals (status, param, message), the response object and its SSE events (parsed by
the openai SDK's own pydantic models), and the store's LRU and TTL."""

from __future__ import annotations

import json

import msgspec
import openai.types.responses as oai
import pydantic
import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from services.api.dialects.responses.reply import ReplyContext, ResponsesReply, echo_fields
from services.api.dialects.responses.routes import not_found
from services.api.dialects.responses.schemas import ResponseObject, ResponsesMessageItem, RespOutputMessage
from services.api.dialects.responses.store import ResponseStore, StoredResponse
from services.api.dialects.responses.translate import (
    as_input,
    chat_body,
    input_items,
    parse_request,
    rename,
    to_messages,
)
from services.api.errors import ApiError
from services.api.events import DeltaEvent, DoneEvent, Usage
from shared.model_source import TokenizerBundle
from tests.checkpoints import CHAT_TEMPLATE
from tests.unit.test_api_openai import MODEL, make_settings, post
from tests.unit.test_api_validation import tiny_tokenizer

STREAM_EVENTS = pydantic.TypeAdapter(oai.ResponseStreamEvent)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(body)
    return info.value


def messages_of(body: dict, before: tuple = ()) -> list[dict]:
    req = parse_request(body)
    items = (*before, *input_items(req))
    return to_messages(items, len(before), req.instructions)[0]


# ---- translation -----------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_after_the_instructions():
    assert messages_of({"input": "hi", "instructions": "be brief"}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_items_become_chat_messages():
    body = {"input": [
        {"role": "developer", "content": "rules"},  # an "easy" message: no type
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_image", "image_url": "data:x"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": ""},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
    ]}
    assert messages_of(body) == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "let me look"}], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
    ]


def test_a_call_without_an_assistant_message_before_it_is_its_own_turn():
    body = {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
            "instructions": "sys"}
    assert messages_of(body)[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_the_previous_conversation_comes_first_and_its_instructions_do_not():
    before = (ResponsesMessageItem(role="user", content="q1"),
              as_input(RespOutputMessage("msg_1", "completed", [])))
    assert messages_of({"input": "q2", "instructions": "new"}, before) == [
        {"role": "system", "content": "new"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": []}, {"role": "user", "content": "q2"}]


def test_settings_become_the_chat_body():
    body = parse_request({
        "model": "m", "input": "x", "max_output_tokens": 7, "temperature": 0, "top_p": 0.5, "stream": True,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low", "summary": "auto"}, "user": "u", "metadata": {"k": "v"}, "store": False,
        "truncation": "disabled", "include": ["reasoning.encrypted_content"]})
    assert chat_body(body, []) == {
        "messages": [], "model": "m", "max_completion_tokens": 7, "temperature": 0.0, "top_p": 0.5,
        "parallel_tool_calls": False, "user": "u", "metadata": {"k": "v"}, "stream": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "name": "n",
                                                                   "strict": True}},
        "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert chat_body(parse_request({"input": "x", "text": {"format": {"type": "json_object"}}}), [])[
        "response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_body(parse_request({"input": "x", "text": {"format": {"type": "text"}}}), [])


@pytest.mark.parametrize(("param", "origins", "want"), [
    ("messages", [], "input"),
    ("messages[1].content[2].image_url.url", ["instructions", "input[0]"], "input[0].content[2].image_url"),
    ("messages[0].tool_calls[0].function.arguments", ["previous_response_id"], "previous_response_id"),
    ("tools[3].function.parameters", [], "tools[3].parameters"),
    ("response_format.json_schema.schema", [], "text.format.schema"),
    ("max_completion_tokens", [], "max_output_tokens"),
    ("tool_choice.function.name", [], "tool_choice.name"),
    ("chat_template_kwargs.reasoning_effort", [], "reasoning.effort"),
    ("temperature", [], "temperature"),
])
def test_chat_fields_are_named_as_the_responses_fields(param, origins, want):
    assert rename(param, origins) == want


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", 'tools[0].type "web_search" is not'),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "mcp", "server_label": "s"}]},
     "tools[1].type", '"mcp" is not supported'),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type", "must be one of input_text, output_text, refusal, input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "must be one of message"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "is required"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "input[0].role"),
    ({"input": "x", "conversation": "c"}, "conversation", "unknown field 'conversation'"),
    ({"input": "x", "truncation": "auto"}, "truncation", '"disabled" only'),
    ({"input": "x", "background": True}, "background", "background is not supported"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "no logprobs"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", "top_logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "an integer >= 1"),
    ({}, "input", "input is required"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name", "is required"),
])
def test_refusals_name_the_field(body, param, words):
    err = refused(body)
    assert (err.status, err.param) == (400, param)
    assert words in err.message


def test_a_call_whose_arguments_are_not_an_object_is_refused():
    with pytest.raises(ApiError) as info:
        messages_of({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]})
    assert info.value.param == "input[0].arguments"


def test_an_image_without_a_url_is_refused():
    with pytest.raises(ApiError) as info:
        messages_of({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})
    assert info.value.param == "input[0].content[0].image_url"


def test_an_unknown_response_id_is_openais_404():
    err = not_found("resp_x", "previous_response_id")
    assert err.status == 404
    assert err.body()["error"] == {"message": "Response with id 'resp_x' not found.", "type": "invalid_request_error",
                                   "param": "previous_response_id", "error_id": None,
                                   "code": "previous_response_not_found"}


# ---- the reply -------------------------------------------------------------------------------


def reply(tool_format: str | None = None, forced: bool = False, reasoning: str | None = None,
          store: ResponseStore | None = None, **body) -> ResponsesReply:
    req = parse_request({"input": "hi", **body})
    ctx = ReplyContext("resp_1", MODEL, 100, echo_fields(req), tool_format, forced, reasoning,
                       tuple(input_items(req)), store, lambda text: len(text.split()))
    return ResponsesReply(ctx)


def done(text: str, finish: str = "stop", completion: int = 4) -> DoneEvent:
    return DoneEvent("resp_1", text, list(range(completion)), finish, Usage(9, completion))


def as_sdk(resp: ResponseObject) -> oai.Response:
    return oai.Response.model_validate(json.loads(msgspec.json.encode(resp)))


def events_of(r: ResponsesReply, deltas: list[str], last: DoneEvent) -> list[tuple[str, dict]]:
    wire = b"".join(r.event(DeltaEvent("resp_1", d, [0])) for d in deltas) + r.event(last)
    out = []
    for block in wire.decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:])
        assert obj["type"] == head[7:]
        STREAM_EVENTS.validate_python(obj)  # the SDK's own model of the event
        out.append((obj["type"], obj))
    assert [o["sequence_number"] for _, o in out] == list(range(len(out)))
    return out


def test_a_text_reply_is_a_message_the_sdk_reads():
    store = ResponseStore()
    resp = as_sdk(reply(store=store, instructions="sys", temperature=0.5).json(done("Paris.")))
    assert (resp.id, resp.object, resp.status, resp.model, resp.output_text) == ("resp_1", "response", "completed",
                                                                                  MODEL, "Paris.")
    assert resp.output[0].type == "message" and resp.output[0].id.startswith("msg_")
    assert resp.output[0].content[0].annotations == []
    assert (resp.instructions, resp.temperature, resp.tool_choice, resp.parallel_tool_calls, resp.store) == (
        "sys", 0.5, "auto", True, True)
    assert resp.usage.model_dump() == {
        "input_tokens": 9, "output_tokens": 4, "total_tokens": 13,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "cache_write_tokens_details": None},
        "output_tokens_details": {"reasoning_tokens": 0}}
    entry = store.get("resp_1")
    assert entry is not None and entry.response.id == "resp_1"
    assert [type(i).__name__ for i in entry.items] == ["ResponsesMessageItem", "ResponsesMessageItem"]


def test_max_output_tokens_makes_it_incomplete():
    resp = as_sdk(reply().json(done("Par", "length")))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"


def test_calls_become_function_call_items():
    text = 'sure\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    resp = as_sdk(reply("hermes").json(done(text)))
    assert [o.type for o in resp.output] == ["message", "function_call"]
    call = resp.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ("f", {"x": 1}, "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert resp.output_text == "sure\n"


def test_thinking_becomes_a_reasoning_item():
    resp = as_sdk(reply(reasoning="open").json(done("let me see</think>\n\nfour")))
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "let me see" and resp.output[0].summary == []
    assert resp.output_text == "four"
    assert resp.usage.output_tokens_details.reasoning_tokens == 3


def test_a_text_stream_is_openais_event_sequence():
    events = events_of(reply(), ["Par", "", "is."], done("Paris."))
    assert [t for t, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0][1]["response"]["status"] == "in_progress"
    assert "".join(o["delta"] for t, o in events if t.endswith(".delta")) == "Paris."
    final = as_sdk(msgspec.json.decode(json.dumps(events[-1][1]["response"]), type=ResponseObject))
    assert final.output_text == "Paris." and final.status == "completed"
    assert final.output[0].id == events[2][1]["item"]["id"] == events[4][1]["item_id"]


def test_an_incomplete_stream_ends_with_response_incomplete():
    events = events_of(reply(), ["Par"], done("Par", "length"))
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_empty_answer_still_has_a_message():
    events = events_of(reply(), [], done(""))
    assert [t for t, _ in events][2:] == ["response.output_item.added", "response.content_part.added",
                                         "response.output_text.done", "response.content_part.done",
                                         "response.output_item.done", "response.completed"]


def test_streamed_calls_and_thinking():
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    r = reply("hermes", forced=True, reasoning="open")
    events = events_of(r, ["hm", "m</th", "ink>\n", text[:9], text[9:]], done("hmm</think>\n" + text))
    assert [t for t, _ in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert json.loads(final["output"][1]["arguments"]) == {"x": 1}
    assert events[-3][1]["arguments"] == final["output"][1]["arguments"]


def test_an_error_mid_stream_is_an_error_event_then_response_failed():
    r = reply()
    r.event(DeltaEvent("resp_1", "a", [0]))
    from services.api.errors import internal_error

    wire = r.error(internal_error("testing")).decode()
    blocks = [b.split("\n") for b in wire.split("\n\n")[:-1]]
    assert [b[0] for b in blocks] == ["event: error", "event: response.failed"]
    failed = json.loads(blocks[1][1][6:])
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["code"] == "server_error"
    STREAM_EVENTS.validate_python(failed)
    assert r.end() == b""


# ---- the store -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(rid: str) -> StoredResponse:
    resp = msgspec.structs.replace(reply().response("completed", []), id=rid)
    return StoredResponse(resp, ())


def test_the_store_evicts_the_least_recently_used():
    store = ResponseStore(max_entries=2)
    store.put(entry("a"))
    store.put(entry("b"))
    assert store.get("a") is not None  # a is now the most recent
    store.put(entry("c"))
    assert (store.get("a") is not None, store.get("b"), store.get("c") is not None) == (True, None, True)
    assert len(store) == 2


def test_stored_responses_expire():
    clock = Clock()
    store = ResponseStore(ttl_s=10, clock=clock)
    store.put(entry("a"))
    clock.now = 5
    store.put(entry("b"))
    clock.now = 9.9
    assert store.get("a") is not None
    clock.now = 10
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 20
    store.put(entry("c"))  # b expired at the cold end: dropped
    assert len(store) == 1


def test_delete_and_a_store_of_none():
    store = ResponseStore()
    store.put(entry("a"))
    assert store.delete("a") is True and store.delete("a") is False
    empty = ResponseStore(max_entries=0)
    empty.put(entry("a"))
    assert empty.get("a") is None
    with pytest.raises(ValueError):
        ResponseStore(ttl_s=0)


# ---- the routes in-process (no peers: refusals, stored responses) ----------------------------


@pytest.fixture()
def client(tmp_path):
    bundle = TokenizerBundle(tiny_tokenizer(), CHAT_TEMPLATE, [0])
    with TestClient(create_app(make_settings(tmp_path, responses_store_max=5), bundle)) as c:
        yield c


def test_routes_answer_for_stored_responses(client):
    status, body = post(client, "/v1/responses", {"input": "x", "previous_response_id": "resp_gone"})
    assert status == 404 and body["error"]["param"] == "previous_response_id"
    assert body["error"]["message"] == "Response with id 'resp_gone' not found."
    for method, path in [("GET", "/v1/responses/resp_gone"), ("DELETE", "/v1/responses/resp_gone"),
                         ("POST", "/v1/responses/resp_gone/cancel")]:
        r = client.request(method, path)
        assert (r.status_code, r.json()["error"]["message"]) == (404, "Response with id 'resp_gone' not found.")
    client.app.state.responses_store.put(entry("resp_kept"))
    assert client.app.state.responses_store.max_entries == 5
    r = client.get("/v1/responses/resp_kept")
    assert r.status_code == 200 and as_sdk(msgspec.json.decode(r.content, type=ResponseObject)).id == "resp_kept"
    r = client.post("/v1/responses/resp_kept/cancel")
    assert r.status_code == 400 and "background=true" in r.json()["error"]["message"]
    r = client.delete("/v1/responses/resp_kept")
    assert r.json() == {"id": "resp_kept", "object": "response", "deleted": True}
    assert client.get("/v1/responses/resp_kept").status_code == 404


def test_refusals_from_the_chat_path_name_the_responses_field(client):
    status, body = post(client, "/v1/responses", {
        "input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"not": {}}}}})
    assert (status, body["error"]["param"]) == (400, "text.format.schema")
    assert body["error"]["message"].startswith("text.format.schema ")
    status, body = post(client, "/v1/responses", {"model": "other", "input": "x"})
    assert (status, body["error"]["param"], body["error"]["code"]) == (404, "model", "model_not_found")
    status, body = post(client, "/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                                                  "tool_choice": {"type": "function", "name": "g"}})
    assert (status, body["error"]["param"]) == (400, "tool_choice.name")
    status, body = post(client, "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]})
    assert (status, body["error"]["param"]) == (400, "input[0].content[1].image_url")


def test_accept_translates_and_store_false_stores_nothing(client):
    from services.api.dialects.responses.routes import accept

    store = ResponseStore()
    state = client.app.state.api
    prepared = accept({"input": "hi", "instructions": "sys", "store": False, "max_output_tokens": 5}, state, store)
    assert prepared.params.request_id.startswith("resp_") and prepared.params.max_tokens == 5
    assert prepared.params.prompt == state.chat_template.render(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], tools=None, extra={})
    prepared.reply.json(done("x"))
    assert len(store) == 0
    kept = accept({"input": "hi"}, state, store)
    kept.reply.json(done("x"))
    assert store.get(kept.params.request_id) is not None


def test_openapi_lists_the_routes_and_their_shapes(client):
    doc = client.get("/openapi.json").json()
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "post" in doc["paths"]["/v1/responses/{response_id}/cancel"]
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert "previous_response_id" in doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert "ResponseObject" in doc["components"]["schemas"]
