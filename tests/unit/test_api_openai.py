"""OpenAI routes in-process without peers: refusals (status, message, param, code), the
model list, the response and chunk shapes, and stop strings inside `Generation`."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from starlette.testclient import TestClient

from services.api.app import create_app
from services.api.backend import RequestHandle
from services.api.chat_request import parse_chat
from services.api.dialects.openai.params import parse_completion
from services.api.dialects.openai.reply import ChatReply, CompletionReply, usage_of
from services.api.errors import ApiError
from services.api.events import DeltaEvent, DoneEvent, Usage
from services.api.generation import Generation
from services.api.metrics import ApiMetrics
from services.api.settings import ApiSettings
from services.api.state import task_refusal
from shared.detokenize import IncrementalDetokenizer
from shared.errors import ErrorKind
from shared.frames import Output
from shared.model_source import TokenizerBundle
from tests.checkpoints import CHAT_TEMPLATE
from tests.unit.test_api_validation import tiny_tokenizer

MODEL = "test-model"
USER = [{"role": "user", "content": "hi"}]


def make_settings(tmp_path, **kw) -> ApiSettings:
    def addr(name: str) -> str:
        return f"ipc://{tmp_path}/{name}.sock"

    return ApiSettings(model_name=MODEL, api_addr=addr("api"), advertise_addr=addr("api"), data_worker_addr=addr("dw"),
                       conductor_addr=addr("c"), control_addr=addr("cc"), max_body_bytes=4096, status_timeout_s=0.2,
                       **kw)


@pytest.fixture()
def client(tmp_path):
    bundle = TokenizerBundle(tiny_tokenizer(), CHAT_TEMPLATE, [0])
    with TestClient(create_app(make_settings(tmp_path), bundle)) as c:
        yield c


@pytest.fixture()
def bare_client(tmp_path):
    with TestClient(create_app(make_settings(tmp_path), tiny_tokenizer())) as c:
        yield c


def post(client: TestClient, path: str, body: object) -> tuple[int, dict]:
    r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return r.status_code, r.json()


def refused(path: str, body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        if path == "completions":
            parse_completion(body, MODEL)
        else:
            parse_chat(body, MODEL)
    return info.value


# ---- parsing ----------------------------------------------------------------------------------


def test_completion_defaults() -> None:
    req = parse_completion({"prompt": "hi"}, MODEL)
    p = req.params
    assert p.max_tokens == 16 and p.prompt == "hi" and p.stop == [] and p.add_special_tokens
    assert p.request_id.startswith("cmpl-") and not req.stream and not req.include_usage and not req.echo


def test_completion_prompt_forms() -> None:
    assert parse_completion({"prompt": ["hi"]}, MODEL).params.prompt == "hi"
    assert parse_completion({"prompt": [1, 2]}, MODEL).params.input_ids == [1, 2]
    assert parse_completion({"prompt": [[3, 4]]}, MODEL).params.input_ids == [3, 4]


def test_chat_fields() -> None:
    req, messages = parse_chat({"messages": [{"role": "user",
                                              "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                                              "name": "x"}],
                                "model": MODEL, "max_completion_tokens": 7, "stop": "\n", "stream": True,
                                "stream_options": {"include_usage": True}, "top_k": 5, "ignore_eos": True, "seed": 3,
                                "user": "u1"}, MODEL)
    assert messages == [{"role": "user", "content": "a\nb", "name": "x"}]
    p = req.params
    assert p.max_tokens == 7 and p.stop == ["\n"] and not p.add_special_tokens and p.request_id.startswith("chatcmpl-")
    assert req.stream and req.include_usage and p.sampling.top_k == 5 and p.sampling.ignore_eos and p.sampling.seed == 3
    assert parse_chat({"messages": USER}, MODEL)[0].params.max_tokens is None  # the most the engine allows


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(
    ("path", "body", "status", "message", "param"),
    [
        ("completions", {"prompt": "x", "n": 17}, 400, "n must be an integer <= 16, got 17", "n"),
        ("completions", {"prompt": "x", "n": 0}, 400, "n must be an integer >= 1, got 0", "n"),
        ("completions", {"prompt": "x", "best_of": 2}, 400, "best_of must equal n (1): samples are not ranked, got 2",
         "best_of"),
        ("completions", {"prompt": ["x"] * 20, "n": 16}, 400, "20 prompts x n=16 is 320 choices; at most 256 are "
         "allowed", "n"),
        ("completions", {"prompt": ["a", ""]}, 400, 'prompt[1] must be a non-empty string, got ""', "prompt[1]"),
        ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs must be an integer in [0, 20], got 21",
         "logprobs"),
        ("completions", {"prompt": "x", "suffix": "y"}, 400, 'suffix is not supported, got "y"', "suffix"),
        ("completions", {}, 400, "prompt is required: a string, a list of token ids, or a list of those",
         "prompt"),
        ("completions", {"prompt": ["a"] * 65}, 400, "prompt holds 65 prompts; at most 64 are allowed",
         "prompt"),
        ("completions", {"prompt": [1, -1]}, 400, "prompt[1] must be an integer in [0, 2147483647], got -1",
         "prompt[1]"),
        ("completions", {"prompt": [1, "a"]}, 400,
         'prompt[1] must be an integer (prompt[0] is a token id), got "a"', "prompt[1]"),
        ("completions", {"prompt": ""}, 400, 'prompt must be a non-empty string, got ""', "prompt"),
        ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
         "stream_options is only allowed when stream is true", "stream_options"),
        ("completions", {"prompt": "x", "stream": True, "stream_options": {"foo": 1}}, 400,
         "unknown field 'foo' in stream_options; allowed fields: include_usage", "stream_options.foo"),
        ("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
         "stream_options.include_usage must be a boolean, got 1", "stream_options.include_usage"),
        ("completions", {"prompt": "x", "model": 5}, 400, "model must be a string, got 5", "model"),
        ("completions", {"prompt": "x", "max_completion_tokens": 5}, 400, None, "max_completion_tokens"),
        ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400,
         "stop must have at most 4 strings, got 5", "stop"),
        ("chat", {"messages": []}, 400, "messages must be a non-empty list of message objects, got []", "messages"),
        ("chat", {"messages": USER, "n": 3.5}, 400, "n must be an integer >= 1, got 3.5", "n"),
        ("chat", {"messages": USER, "best_of": 2}, 400, "best_of > 1 is not supported; best_of must be 1, got 2",
         "best_of"),
        ("chat", {"messages": USER, "logprobs": 1}, 400, "logprobs must be a boolean, got 1", "logprobs"),
        ("chat", {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs needs logprobs: true", "top_logprobs"),
        ("chat", {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
         "top_logprobs must be an integer in [0, 20], got 21", "top_logprobs"),
        ("chat", {"messages": USER, "tools": [{"type": "function"}]}, 400,
         'tools[0].function is required: an object {"name", "description", "parameters"}', "tools[0].function"),
        ("chat", {"messages": USER, "tools": [5]}, 400,
         'tools[0] must be {"type": "function", "function": {"name", "parameters"}}, got 5', "tools[0]"),
        ("chat", {"messages": USER, "tool_choice": "required"}, 400, 'tool_choice "required" needs tools',
         "tool_choice"),
        ("chat", {"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         400, 'tool_choice names function "x", which is not in tools (get_weather)', "tool_choice.function.name"),
        ("chat", {"messages": USER, "tools": [TOOL], "tool_choice": "required",
                  "response_format": {"type": "json_object"}}, 400,
         "tool_choice required or a named function cannot be combined with a structured-output constraint "
         "(response_format, structured_outputs, guided_*)", "tool_choice"),
        ("chat", {"messages": USER, "response_format": {"type": "json_schema"}}, 400,
         'response_format.json_schema is required: an object with "name" and "schema"', "response_format.json_schema"),
        ("chat", {"messages": USER, "echo": True}, 400, "echo is not supported, got true", "echo"),
        ("chat", {"messages": USER, "max_tokens": 3, "max_completion_tokens": 4}, 400,
         "max_tokens (3) and max_completion_tokens (4) disagree; give one", "max_completion_tokens"),
        ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400,
         'messages[0].role must be one of system, developer, user, assistant, tool, got "robot"', "messages[0].role"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400,
         "messages[0].tool_call_id must be the id of the call this result answers", "messages[0].tool_call_id"),
        ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
         "messages[0].tool_calls is only for an assistant message", "messages[0].tool_calls"),
        ("chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content is required for a user message",
         "messages[0].content"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
            "data": "AAAA", "format": "wav"}}]}]}, 400,
         "the served model takes no audio inputs: messages[0].content[0] is an input_audio part",
         "messages[0].content[0]"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, 400,
         'messages[0].content[0].type must be one of text, image_url, input_audio, video_url, got "file"',
         "messages[0].content[0].type"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
         400, "the served model takes no video inputs: messages[0].content[0] is a video_url part",
         "messages[0].content[0]"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x",
                                                                                             "detail": "high"}}]}]},
         400, None, "messages[0].content[0].image_url.detail"),
        ("chat", {"messages": [{"role": "user", "content": "x", "audio": 1}]}, 400, None, "messages[0].audio"),
        ("chat", {"messages": USER, "prompt": "x"}, 400, None, "prompt"),
        ("chat", {"messages": USER, "model": "gpt-4o"}, 404,
         "The model `gpt-4o` does not exist; this server serves `test-model`.", "model"),
    ],
)
def test_refusals(path: str, body: dict, status: int, message: str | None, param: str) -> None:
    err = refused(path, body)
    assert (err.status, err.param) == (status, param)
    if message is not None:
        assert err.message == message


def test_output_neutral_fields_are_accepted_and_type_checked() -> None:
    neutral = {"user": "u1", "metadata": {"team": "eval", "run": "7"}, "store": True, "service_tier": "flex",
               "prompt_cache_key": "k", "safety_identifier": "s"}
    assert parse_completion({"prompt": "x", **neutral}, MODEL).params.max_tokens == 16
    assert parse_chat({"messages": USER, **neutral}, MODEL)[0].params.max_tokens is None
    for field, value, message, param in [
        ("store", "yes", 'store must be a boolean, got "yes"', "store"),
        ("service_tier", "gold", 'service_tier must be one of auto, default, flex, priority, scale, got "gold"',
         "service_tier"),
        ("user", 5, "user must be a string, got 5", "user"),
        ("metadata", [], "metadata must be an object of at most 16 string values (keys up to 64 characters, "
                         "values up to 512), got []", "metadata"),
        ("metadata", {"k": 1}, 'metadata["k"] must be a string of up to 512 characters, got 1', 'metadata["k"]'),
        ("metadata", {str(i): "v" for i in range(17)}, "metadata must have at most 16 entries, got 17", "metadata"),
    ]:
        err = refused("chat", {"messages": USER, field: value})
        assert (err.status, err.message, err.param) == (400, message, param)


def test_model_not_found_has_openai_code() -> None:
    err = refused("completions", {"prompt": "x", "model": "nope"})
    assert err.body() == {"error": {"message": "The model `nope` does not exist; this server serves `test-model`.",
                                    "type": "invalid_request_error", "param": "model", "error_id": None,
                                    "code": "model_not_found"}}


# ---- over HTTP ---------------------------------------------------------------------------------


def test_models_routes(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert set(body["data"][0]) == {"id", "object", "created", "owned_by", "max_model_len", "input_modalities",
                                    "output_modalities", "image_placeholder", "audio_placeholder", "video_placeholder",
                                    "default_sampling", "parameters", "active_parameters", "task"}
    card = body["data"][0]
    assert card["task"] == "generate"
    assert (card["input_modalities"], card["output_modalities"]) == (["text"], ["text"])
    assert card["image_placeholder"] is None and card["audio_placeholder"] is None
    assert card["default_sampling"] is None  # no generation_config.json
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_http_refusals_use_the_error_shape(client: TestClient) -> None:
    status, body = post(client, "/v1/chat/completions", {"messages": USER, "n": 20})
    assert status == 400
    assert body == {"error": {"message": "n must be an integer <= 16, got 20", "type": "invalid_request_error",
                              "param": "n", "error_id": None, "code": None}}
    status, body = post(client, "/v1/completions", {"prompt": "x" * 5000})
    assert status == 413 and body["error"]["message"] == "request body exceeds 4096 bytes"


def test_a_text_model_refuses_an_image_naming_the_part(client: TestClient) -> None:
    """Nothing is fetched and nothing reaches the worker: the part is named."""
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never-fetched.png"}}
    status, body = post(client, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "see"}, image]}]})
    assert status == 400 and body["error"]["param"] == "messages[1].content[1]"
    assert body["error"]["message"] == ("the served model `test-model` takes no images: "
                                        "messages[1].content[1] is an image")
    status, body = post(client, "/generate", {"prompt": "x", "images": ["http://127.0.0.1:9/x.png"]})
    assert status == 400 and body["error"]["param"] == "images[0]"


def test_chat_without_template_is_400(bare_client: TestClient) -> None:
    status, body = post(bare_client, "/v1/chat/completions", {"messages": USER})
    assert status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["message"] == ("the model `test-model` has no chat template; "
                                        "use /v1/completions with a formatted prompt")


def test_unknown_route_and_method_are_json(client: TestClient) -> None:
    r = client.get("/v1/nonesuch")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route /v1/nonesuch"
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == "method GET is not allowed on /v1/completions"


def test_generate_accepts_stop(client: TestClient) -> None:
    status, body = post(client, "/generate", {"prompt": "x", "stop": 3})
    assert status == 400 and body["error"]["param"] == "stop"


# ---- response shapes ---------------------------------------------------------------------------


def _sse(raw: bytes) -> list[object]:
    out: list[object] = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


DONE = DoneEvent("r", "ab", [1, 2], "stop", Usage(5, 2))


def test_chat_chunks() -> None:
    reply = ChatReply("chatcmpl-1", MODEL, 7, include_usage=True)
    raw = (reply.event(DeltaEvent("r", "a", [1])) + reply.event(DeltaEvent("r", "", [9]))
           + reply.event(DeltaEvent("r", "b", [2])))
    raw += reply.event(DONE) + reply.end()
    chunks = _sse(raw)
    assert chunks[-1] == "[DONE]"
    base = {"id": "chatcmpl-1", "created": 7, "model": MODEL, "object": "chat.completion.chunk"}
    assert chunks[0] == {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None, "logprobs": None, "stop_reason": None}],
                         "usage": None}
    assert [c["choices"][0]["delta"] for c in chunks[1:4]] == [{"content": "a"}, {"content": "b"}, {}]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[4] == {**base, "choices": [],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
    assert reply.json(DONE).choices[0].message.content == "ab"


def test_completion_chunks_without_usage_and_with_echo() -> None:
    reply = CompletionReply("cmpl-1", MODEL, 7, echo="PROMPT")
    chunks = _sse(reply.event(DeltaEvent("r", "a", [1])) + reply.event(DONE) + reply.end())
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["PROMPT", "a", ""]
    assert all("usage" not in c for c in chunks[:-1])
    assert chunks[2]["choices"][0]["finish_reason"] == "stop" and chunks[0]["object"] == "text_completion"
    assert CompletionReply("cmpl-1", MODEL, 7, echo="P").json(DONE).choices[0].text == "Pab"


def test_error_chunk_is_openai_error() -> None:
    reply = CompletionReply("cmpl-1", MODEL, 7)
    assert _sse(reply.error(ApiError(ErrorKind.UNAVAILABLE, "server is shutting down"))) == [
        {"error": {"message": "server is shutting down", "type": "service_unavailable", "param": None,
                   "error_id": None, "code": None}}]


# ---- stop strings inside Generation -------------------------------------------------------------


class FakeBackend:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, str]] = []

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborts.append((request_id, reason))


async def test_stop_aborts_upstream_and_trims() -> None:
    tok = tiny_tokenizer()
    tok.add_tokens(["Hel", "lo", " wor", "ld", "!"])
    ids = {t: tok.token_to_id(t) for t in ("Hel", "lo", " wor", "ld", "!")}
    backend = FakeBackend()
    handle = RequestHandle("r1", backend)  # type: ignore[arg-type]
    gen = Generation(handle, IncrementalDetokenizer(tok), ApiMetrics(), client_id="c1", started=0.0, stop=["o wo"])
    for t in ("Hel", "lo", " wor", "ld"):
        handle.put(Output("r1", [ids[t]], None, prompt_tokens=3))
    events = [e async for e in gen.events()]
    assert backend.aborts == [("r1", "stop")]
    assert [e.text for e in events[:-1]] == ["Hel", "l", ""] and events[-1].text == "Hell"
    done = events[-1]
    assert done.finish_reason == "stop" and done.token_ids == [ids["Hel"], ids["lo"], ids[" wor"]]
    assert done.usage == Usage(3, 3)
    gen.close()
    assert backend.aborts == [("r1", "stop")]  # not aborted twice
    await asyncio.sleep(0)


@pytest.mark.parametrize("finish", [None, "length"])
async def test_stop_inside_a_speculative_burst_ends_at_the_same_token(finish) -> None:
    """Several tokens in one Output (accepted drafts): the request ends at the token that
    completes the stop string, as it does when they arrive one per frame."""
    tok = tiny_tokenizer()
    tok.add_tokens(["Hel", "lo", " wor", "ld", "!"])
    ids = {t: tok.token_to_id(t) for t in ("Hel", "lo", " wor", "ld", "!")}

    async def run(frames: list[list[int]], last_finish: str | None):
        backend = FakeBackend()
        handle = RequestHandle("r1", backend)  # type: ignore[arg-type]
        gen = Generation(handle, IncrementalDetokenizer(tok), ApiMetrics(), client_id="c1", started=0.0, stop=["o wo"])
        for i, frame in enumerate(frames):
            handle.put(Output("r1", frame, last_finish if i == len(frames) - 1 else None, prompt_tokens=3))
        events = [e async for e in gen.events()]
        return events[-1], backend.aborts

    seq = [ids[t] for t in ("Hel", "lo", " wor", "ld", "!")]
    one_by_one, aborts_one = await run([[t] for t in seq[:3]], None)
    burst, aborts_burst = await run([seq[:1], seq[1:]], finish)
    assert burst.text == one_by_one.text == "Hell"
    assert burst.token_ids == one_by_one.token_ids == seq[:3]
    assert burst.usage == one_by_one.usage == Usage(3, 3) and burst.finish_reason == "stop"
    assert aborts_one == [("r1", "stop")]
    assert aborts_burst == ([("r1", "stop")] if finish is None else [])  # a finished request needs no abort


@pytest.mark.parametrize("report", [False, True])
async def test_usage_shows_the_cached_prompt_tokens_when_asked(report) -> None:
    """The prefix cache's served rows (the first Output's cached_tokens) reach usage only with
    --enable-prompt-tokens-details (vLLM's flag): /generate's `cached_tokens`, OpenAI's
    `prompt_tokens_details`; without it both shapes stay as they were."""
    tok = tiny_tokenizer()
    handle = RequestHandle("r1", FakeBackend())  # type: ignore[arg-type]
    gen = Generation(handle, IncrementalDetokenizer(tok), ApiMetrics(), client_id="c1", started=0.0,
                     report_cached=report)
    handle.put(Output("r1", [5], None, prompt_tokens=40, cached_tokens=32))
    handle.put(Output("r1", [6], "length", prompt_tokens=40))
    done = [e async for e in gen.events()][-1]
    assert done.usage == Usage(40, 2, 32 if report else None)
    usage = json.loads(msgspec.json.encode(usage_of(done)))
    want = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    assert usage == ({**want, "prompt_tokens_details": {"cached_tokens": 32}} if report else want)
    assert json.loads(msgspec.json.encode(done.usage)) == (
        {"prompt_tokens": 40, "completion_tokens": 2, **({"cached_tokens": 32} if report else {})})
    gen.close()


def test_chat_on_an_embedding_model_names_its_task_and_routes(tmp_path) -> None:
    bundle = TokenizerBundle(tiny_tokenizer(), CHAT_TEMPLATE, [0])
    with TestClient(create_app(make_settings(tmp_path, task="embed"), bundle)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"] == task_refusal(MODEL, "embed", "generate")
    assert "/v1/embeddings" in r.json()["error"]["message"]
