"""/generate validation: exact statuses, messages and params, in-process and without peers.

Every refusal here happens before anything is submitted, so no other service is needed.
The WebSocket tests at the end submit for real into ZMQ queues nobody reads, which is
enough to check duplicate ids, the per-socket limit and cancel (cancel is answered by the
api itself)."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.api.app import create_app
from services.api.errors import ApiError
from services.api.settings import ApiSettings
from services.api.validation import SEED_MAX, parse_generate


def tiny_tokenizer() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t


@pytest.fixture()
def settings(tmp_path) -> ApiSettings:
    def addr(name: str) -> str:
        return f"ipc://{tmp_path}/{name}.sock"

    return ApiSettings(
        model_name="test-model",
        api_addr=addr("api"),
        advertise_addr=addr("api"),
        data_worker_addr=addr("data-worker"),
        conductor_addr=addr("conductor"),
        control_addr=addr("conductor-control"),
        max_body_bytes=4096,
        ws_max_live=2,
        status_timeout_s=0.2,
    )


@pytest.fixture()
def client(settings: ApiSettings):
    with TestClient(create_app(settings, tiny_tokenizer())) as c:
        yield c


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_generate(body)
    return info.value


# ---- parse_generate -------------------------------------------------------------------


def test_minimal_prompt_gets_defaults_and_generated_id() -> None:
    p = parse_generate({"prompt": "hi"})
    assert p.prompt == "hi" and p.input_ids is None and p.max_tokens is None and p.stream is None
    assert p.request_id.startswith("gen-") and len(p.request_id) == 36
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == (1.0, 1.0, 0, None, False)


def test_all_fields() -> None:
    p = parse_generate(
        {"input_ids": [1, 2, 3], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1,
         "seed": 42, "ignore_eos": True, "stream": True, "request_id": "Ab9._:-x"}
    )
    assert p.input_ids == [1, 2, 3] and p.max_tokens == 7 and p.stream is True and p.request_id == "Ab9._:-x"
    assert p.sampling.greedy and p.sampling.top_p == 0.5 and p.sampling.top_k == 0
    assert p.sampling.seed == 42 and p.sampling.ignore_eos is True
    assert isinstance(p.sampling.temperature, float)


def test_null_means_not_given() -> None:
    p = parse_generate({"prompt": "x", "max_tokens": None, "seed": None, "temperature": None, "n": None, "stop": None})
    assert p.max_tokens is None and p.sampling.seed is None and p.sampling.temperature == 1.0


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1, got 0", "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens must be an integer >= 1, got true", "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, 'max_tokens must be an integer >= 1, got "5"', "max_tokens"),
        ({"prompt": "x", "max_tokens": 5.0}, "max_tokens must be an integer >= 1, got 5.0", "max_tokens"),
        ({"prompt": "x", "max_tokens": 2**31}, "max_tokens must be an integer <= 2147483647, got 2147483648",
         "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature must be a number >= 0 (0 = greedy), got -0.5",
         "temperature"),
        ({"prompt": "x", "temperature": False}, "temperature must be a number >= 0 (0 = greedy), got false",
         "temperature"),
        ({"prompt": "x", "temperature": 10**400}, "temperature must be a number >= 0 (0 = greedy), got ",
         "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p must be a number in (0, 1], got 0", "top_p"),
        ({"prompt": "x", "top_p": 1.01}, "top_p must be a number in (0, 1], got 1.01", "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k must be an integer >= 1, or 0 or -1 for off, got -2", "top_k"),
        ({"prompt": "x", "top_k": 1.5}, "top_k must be an integer >= 1, or 0 or -1 for off, got 1.5", "top_k"),
        ({"prompt": "x", "seed": -1}, f"seed must be an integer in [0, {SEED_MAX}], got -1", "seed"),
        ({"prompt": "x", "seed": 2**63}, f"seed must be an integer in [0, {SEED_MAX}], got {2**63}", "seed"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos must be a boolean, got 1", "ignore_eos"),
        ({"prompt": "x", "stream": "true"}, 'stream must be a boolean, got "true"', "stream"),
        ({"prompt": "x", "request_id": ""},
         'request_id must be a string of 1-128 characters from [A-Za-z0-9._:-], got ""', "request_id"),
        ({"prompt": "x", "request_id": "a b"},
         'request_id must be a string of 1-128 characters from [A-Za-z0-9._:-], got "a b"', "request_id"),
        ({"prompt": "x", "request_id": 5},
         "request_id must be a string of 1-128 characters from [A-Za-z0-9._:-], got 5", "request_id"),
        ({"prompt": "x", "request_id": "a\n"},
         'request_id must be a string of 1-128 characters from [A-Za-z0-9._:-], got "a\\n"', "request_id"),
        ({}, "one of prompt (a string) or input_ids (a list of integers) is required", "prompt"),
        ({"prompt": "x", "input_ids": [1]}, "prompt and input_ids are mutually exclusive; give exactly one",
         "input_ids"),
        ({"prompt": ""}, 'prompt must be a non-empty string, got ""', "prompt"),
        ({"prompt": ["a"]}, 'prompt must be a non-empty string, got ["a"]', "prompt"),
        ({"input_ids": []}, "input_ids must be a non-empty list of integers >= 0, got []", "input_ids"),
        ({"input_ids": "1 2"}, 'input_ids must be a non-empty list of integers >= 0, got "1 2"', "input_ids"),
        ({"input_ids": [1, -1]}, "input_ids[1] must be an integer in [0, 2147483647], got -1", "input_ids[1]"),
        ({"input_ids": [1, 2, True]}, "input_ids[2] must be an integer in [0, 2147483647], got true", "input_ids[2]"),
        ({"input_ids": [2**31]}, "input_ids[0] must be an integer in [0, 2147483647], got 2147483648",
         "input_ids[0]"),
        ({"prompt": "x", "n": 2}, "n > 1 is not supported; n must be 1, got 2", "n"),
        ({"prompt": "x", "best_of": 3}, "best_of > 1 is not supported; best_of must be 1, got 3", "best_of"),
        ({"prompt": "x", "logprobs": 21}, "logprobs must be an integer in [0, 20], got 21", "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs must be an integer in [0, 20], got true", "logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs must be an integer in [0, 20], got -1",
         "prompt_logprobs"),
        ({"prompt": "x", "stop": 5}, "stop must be a string or a list of up to 4 strings, got 5", "stop"),
        ({"prompt": "x", "stop": ""}, 'stop must be a non-empty string, got ""', "stop"),
        ({"prompt": "x", "stop": ["a", ""]}, 'stop[1] must be a non-empty string, got ""', "stop[1]"),
        ({"prompt": "x", "stop": ["a", 1]}, "stop[1] must be a non-empty string, got 1", "stop[1]"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop must have at most 4 strings, got 5", "stop"),
        ({"prompt": "x", "stop": ["y" * 513]}, "stop[0] must be at most 512 characters, got 513", "stop[0]"),
        ({"prompt": "x", "stop_token_ids": [7, -1]}, "stop_token_ids[1] must be an integer in [0, 2147483647], got -1",
         "stop_token_ids[1]"),
        ({"prompt": "x", "stop_token_ids": 7}, "stop_token_ids must be a list of up to 256 token ids, got 7",
         "stop_token_ids"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens must be an integer >= 0, got -1", "min_tokens"),
        ({"prompt": "x", "min_tokens": 3, "max_tokens": 2}, "min_tokens (3) must be at most max_tokens (2)",
         "min_tokens"),
        ({"prompt": "x", "logit_bias": []}, "logit_bias must be an object mapping token ids to numbers in [-100, 100], "
         "got []", "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-3": 1}}, 'logit_bias["-3"] must be keyed by a token id (a non-negative '
         'integer), got "-3"', 'logit_bias["-3"]'),
        ({"prompt": "x", "logit_bias": {"3": True}}, 'logit_bias["3"] must be a number in [-100, 100], got true',
         'logit_bias["3"]'),
        ({"prompt": "x", "min_p": -0.1}, "min_p must be a number in [0, 1], got -0.1", "min_p"),
        ({"prompt": "x", "repetition_penalty": -1}, "repetition_penalty must be a number > 0 (1 = off), got -1",
         "repetition_penalty"),
        ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty must be a number in [-2, 2], got -2.5",
         "frequency_penalty"),
        ({"prompt": "x", "stream_options": {"include_usage": True}},
         'stream_options is only supported on the /v1 routes, got {"include_usage":true}', "stream_options"),
        ({"prompt": "x", "response_format": {"type": "xml"}},
         'response_format.type must be one of text, json_object, json_schema, got "xml"', "response_format.type"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, 'tools is not supported, got [{"type":"function"}]',
         "tools"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5",
         "presence_penalty"),
    ],
)
def test_refusals(body: dict, message: str, param: str) -> None:
    err = refused(body)
    assert err.status == 400 and err.type == "invalid_request_error" and err.param == param
    if message.endswith("got "):
        assert err.message.startswith(message)
    else:
        assert err.message == message


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    parse_generate({"prompt": "x", "n": 1, "best_of": 1, "logprobs": None, "stop": [], "tools": [],
                    "presence_penalty": 0.0, "response_format": {"type": "text"}})


def test_sampling_fields_reach_the_frame() -> None:
    got = parse_generate({"prompt": "x", "max_tokens": 9, "presence_penalty": -0.5, "frequency_penalty": 1,
                          "repetition_penalty": 1.2, "min_p": 0.05, "logit_bias": {"7": -100, "12": 2.5},
                          "min_tokens": 3, "stop_token_ids": [4, 4, 9], "logprobs": 0, "prompt_logprobs": 5}).sampling
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty, got.min_p) == (-0.5, 1.0, 1.2, 0.05)
    assert got.logit_bias == {7: -100.0, 12: 2.5} and got.min_tokens == 3 and got.stop_token_ids == [4, 9]
    assert (got.logprobs, got.prompt_logprobs) == (0, 5) and got.processed
    plain = parse_generate({"prompt": "x"}).sampling
    assert not plain.processed and plain.logprobs is None and plain.prompt_logprobs is None


def test_stop_forms() -> None:
    assert parse_generate({"prompt": "x", "stop": "\n"}).stop == ["\n"]
    assert parse_generate({"prompt": "x", "stop": ["a", "bc", "a"]}).stop == ["a", "bc"]
    assert parse_generate({"prompt": "x", "stop": []}).stop == []
    assert parse_generate({"prompt": "x"}).stop == []


def test_unknown_field_names_it() -> None:
    err = refused({"prompt": "x", "max_token": 5})
    assert err.param == "max_token"
    assert err.message.startswith("unknown field 'max_token'; "
                                  "allowed fields: audios, context, frequency_penalty, guided_choice, guided_grammar, "
                                  "guided_json, guided_regex, ignore_eos, images, input_ids, logit_bias, logprobs, "
                                  "max_tokens, min_p, min_tokens, presence_penalty, prompt,")


def test_internal_fields_are_refused() -> None:
    for name in ("reply_to", "model", "arrival_time", "sampling"):
        assert refused({"prompt": "x", name: "y"}).param == name


def test_unknown_field_is_reported_before_other_errors() -> None:
    assert refused({"max_tokens": 0, "bogus": 1}).param == "bogus"


# ---- over HTTP ---------------------------------------------------------------------------


def post(client: TestClient, body: object, **kw) -> tuple[int, dict]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post("/generate", content=content, headers={"content-type": "application/json"}, **kw)
    return r.status_code, r.json()


def test_http_error_body_shape(client: TestClient) -> None:
    status, body = post(client, {"prompt": "hi", "max_tokens": 0})
    assert status == 400
    assert body == {"error": {"message": "max_tokens must be an integer >= 1, got 0", "type": "invalid_request_error",
                              "param": "max_tokens", "error_id": None, "code": None}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "request body is empty; expected a JSON object"),
        (b"[1, 2]", "request body must be a JSON object, got an array"),
        (b'"prompt"', "request body must be a JSON object, got a string"),
        (b"null", "request body must be a JSON object, got null"),
        (b'{"prompt": "x", "temperature": NaN}',
         "request body is not valid JSON: JSON is malformed: invalid character (byte 31)"),
        (b'{"prompt": "x", "temperature": Infinity}',
         "request body is not valid JSON: JSON is malformed: invalid character (byte 31)"),
        (b'{"prompt": "x", "temperature": 1e999}', "request body is not valid JSON: Number out of range - at `$[...]`"),
        (b'{"prompt": "\xff"}', "request body is not valid JSON: Invalid UTF-8 encoded string"),
        (b'{"prompt": "x"', "request body is not valid JSON: Input data was truncated"),
    ],
)
def test_http_bad_json(client: TestClient, raw: bytes, message: str) -> None:
    status, body = post(client, raw)
    assert status == 400
    assert body["error"]["message"] == message
    assert body["error"]["param"] is None


def test_http_body_too_large(client: TestClient) -> None:
    status, body = post(client, {"prompt": "x" * 5000})
    assert status == 413
    assert body["error"] == {"message": "request body exceeds 4096 bytes", "type": "request_too_large", "param": None,
                             "error_id": None, "code": None}


def test_http_body_too_large_without_content_length(client: TestClient) -> None:
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = client.post("/generate", content=chunks())
    assert r.status_code == 413


def test_http_stream_flag_validated(client: TestClient) -> None:
    status, body = post(client, {"prompt": "x", "stream": 1})
    assert status == 400 and body["error"]["param"] == "stream"


def test_http_method_and_path(client: TestClient) -> None:
    assert client.get("/generate").status_code == 405
    assert client.get("/nope").status_code == 404


def test_health_ready_metrics_without_peers(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = client.get("/ready")
    assert r.status_code == 503
    assert r.json() == {"status": "not_ready", "reason": "conductor did not answer within 0.2 s"}
    post(client, {"prompt": "x", "top_p": 2})
    text = client.get("/metrics").text
    assert 'mstar_requests_total{model_name="test-model",status="error_4xx"} 1.0' in text
    assert 'mstar_requests_total{model_name="test-model",status="ok"} 0.0' in text
    assert 'mstar_conductor_up{model_name="test-model"} 0.0' in text
    assert "# TYPE mstar_ttft_seconds histogram" in text and "# TYPE mstar_itl_seconds histogram" in text


def test_app_starts_without_lifespan(settings: ApiSettings) -> None:
    c = TestClient(create_app(settings, tiny_tokenizer()))  # no `with`: no lifespan, no sockets
    status, body = post(c, {"prompt": "x", "bogus": True})
    assert status == 400 and body["error"]["param"] == "bogus"


# ---- over the WebSocket ----------------------------------------------------------------------


def test_ws_bad_frames_leave_the_socket_alone(client: TestClient) -> None:
    with client.websocket_connect("/generate/ws") as ws:
        ws.send_text("not json")
        e = ws.receive_json()
        assert e["type"] == "error" and e["id"] is None and e["status"] == 400
        assert e["error"]["message"].startswith("frame is not valid JSON: ")

        ws.send_text(json.dumps({"type": "generate", "id": "r1", "prompt": "x", "max_tokens": 0}))
        assert ws.receive_json() == {
            "type": "error", "id": "r1", "status": 400,
            "error": {"message": "max_tokens must be an integer >= 1, got 0", "type": "invalid_request_error",
                      "param": "max_tokens", "error_id": None, "code": None},
        }

        ws.send_text(json.dumps({"type": "nope", "id": "r2"}))
        e = ws.receive_json()
        assert (e["id"], e["status"], e["error"]["message"], e["error"]["param"]) == (
            "r2", 400, 'type must be "generate" or "cancel", got "nope"', "type")

        ws.send_text(json.dumps({"type": "generate", "prompt": "x"}))
        e = ws.receive_json()
        assert (e["id"], e["error"]["message"], e["error"]["param"]) == (
            None, "id is required: a string of 1-128 characters", "id")

        ws.send_text(json.dumps({"type": "generate", "id": "r3", "prompt": "x", "type2": 1}))
        e = ws.receive_json()
        assert e["id"] == "r3" and e["error"]["param"] == "type2"

        ws.send_text(json.dumps({"type": "cancel", "id": "ghost"}))
        e = ws.receive_json()
        assert (e["id"], e["status"], e["error"]["message"]) == (
            "ghost", 404, "no live request with id 'ghost' on this socket")

        ws.send_text("x" * 5000)
        e = ws.receive_json()
        assert (e["status"], e["error"]["message"]) == (413, "frame exceeds 4096 bytes")


def test_ws_duplicate_limit_and_cancel(client: TestClient) -> None:
    """Requests are really submitted (into queues no peer reads); cancel is answered by the api."""
    with client.websocket_connect("/generate/ws") as ws:
        ws.send_text(json.dumps({"type": "generate", "id": "a", "input_ids": [5, 6]}))
        ws.send_text(json.dumps({"type": "generate", "id": "a", "prompt": "again"}))
        e = ws.receive_json()
        assert (e["id"], e["status"], e["error"]["message"], e["error"]["param"]) == (
            "a", 409, "id 'a' is already live on this socket", "id")

        ws.send_text(json.dumps({"type": "generate", "id": "b", "prompt": "x", "request_id": "wire-b"}))
        ws.send_text(json.dumps({"type": "generate", "id": "c", "prompt": "x"}))
        e = ws.receive_json()
        assert (e["id"], e["status"], e["error"]["message"], e["error"]["type"]) == (
            "c", 429, "too many live requests on this socket (limit 2)", "rate_limit_error")

        ws.send_text(json.dumps({"type": "cancel", "id": "a"}))
        assert ws.receive_json() == {
            "type": "done", "id": "a", "text": "", "token_ids": [], "finish_reason": "abort",
            "usage": {"prompt_tokens": 2, "completion_tokens": 0},
        }
        # the wire request_id of b is live server-wide: another socket may not reuse it
        with client.websocket_connect("/generate/ws") as ws2:
            ws2.send_text(json.dumps({"type": "generate", "id": "z", "prompt": "x", "request_id": "wire-b"}))
            e = ws2.receive_json()
            assert (e["id"], e["status"], e["error"]["message"]) == (
                "z", 409, "request_id 'wire-b' is already in use by a live request")
        ws.send_text(json.dumps({"type": "cancel", "id": "b"}))
        assert ws.receive_json()["finish_reason"] == "abort"

    text = client.get("/metrics").text
    assert 'mstar_requests_total{model_name="test-model",status="abort"} 2.0' in text
    assert 'mstar_requests_total{model_name="test-model",status="error_4xx"} 3.0' in text


def test_context_turns_decode_their_audio() -> None:
    """CSM's context turns: base64 (or a data: URL's payload) to the file's bytes; text
    that is not base64, an empty turn text and input_ids with context refused by name."""
    import base64

    turns = [{"speaker": "0", "text": "hi", "audio": base64.b64encode(b"RIFF....").decode()},
             {"speaker": "1", "text": "text alone"},
             {"speaker": "0", "text": "url", "audio": "data:audio/wav;base64," + base64.b64encode(b"abc").decode()}]
    params = parse_generate({"prompt": "x", "context": turns})
    assert [(t.speaker, t.text, t.audio) for t in params.context] == [
        ("0", "hi", b"RIFF...."), ("1", "text alone", None), ("0", "url", b"abc")]
    assert refused({"prompt": "x", "context": [turns[0], {**turns[1], "audio": "%%%"}]}).param == "context[1].audio"
    assert refused({"prompt": "x", "context": [{"speaker": "0", "text": ""}]}).param == "context[0].text"
    assert refused({"prompt": "x", "context": [{"speaker": "0", "text": "a", "tone": 1}]}).param == "context[0].tone"
    assert refused({"input_ids": [1], "context": turns[:1]}).param == "input_ids"
