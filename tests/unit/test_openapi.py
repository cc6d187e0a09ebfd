"""`/openapi.json` is generated from the routes' declared Structs (`schemas.py`): every POST
route has its body in it, every reference resolves, every component is valid JSON Schema,
and the schema accepts and refuses the bodies the server accepts and refuses."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from services.api import dialects, openapi, schemas
from services.api.app import create_app
from services.api.errors import ApiError
from services.api.validation import load
from tests.unit.test_api_openai import make_settings
from tests.unit.test_api_validation import tiny_tokenizer

DOC = openapi.openapi("test", dialects.shapes())  # as /openapi.json publishes it
COMPONENTS = DOC["components"]["schemas"]
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def validator(path: str, content: str = "application/json") -> jsonschema.Draft202012Validator:
    schema = DOC["paths"][path]["post"]["requestBody"]["content"][content]["schema"]
    return jsonschema.Draft202012Validator({**schema, "components": DOC["components"]})


@pytest.fixture()
def app(tmp_path):
    return create_app(make_settings(tmp_path), tiny_tokenizer())


def test_every_post_route_has_its_body(app) -> None:
    posts = [r.path for r in app.routes if isinstance(r, Route) and "POST" in (r.methods or ())]
    assert len(posts) >= 6
    declared = {**openapi.ROUTES, **dialects.shapes()}
    for path in posts:
        shape = declared[(path, "post")]  # every POST route is declared
        if shape.body is None and shape.form is None:  # an action on a path (a response's cancel)
            assert "requestBody" not in DOC["paths"][path]["post"], path
            continue
        assert DOC["paths"][path]["post"]["requestBody"]["content"], path
    generate = DOC["paths"]["/generate"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(generate)
    assert DOC["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"


def test_the_document_is_openapi_and_its_references_resolve() -> None:
    assert DOC["openapi"].startswith("3.1") and DOC["info"] == {"title": "mstar", "version": "test"}
    found = refs(DOC)
    assert found and all(r.startswith("#/components/schemas/") for r in found)
    assert {r.rsplit("/", 1)[1] for r in found} <= set(COMPONENTS)
    for operation in (op for ops in DOC["paths"].values() for op in ops.values()):
        assert operation["responses"]["default"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_every_component_is_json_schema(name: str) -> None:
    jsonschema.Draft202012Validator.check_schema(COMPONENTS[name])


def test_unsupported_fields_are_listed_with_their_neutral_values() -> None:
    n = COMPONENTS["GenerateRequest"]["properties"]["n"]
    assert n["enum"] == [None, 1] and "not supported" in n["description"]
    honoured = COMPONENTS["CompletionRequest"]["properties"]["n"]["anyOf"]  # honoured there
    assert {"type": "integer", "minimum": 1, "maximum": schemas.MAX_N} in honoured
    assert "n" not in COMPONENTS["TokenizeCompletionRequest"]["properties"]  # not a generating route
    form = COMPONENTS["TranscriptionForm"]
    assert "file" in form["required"] and form["properties"]["file"]["type"] == "string"


GOOD = [
    ("/generate", schemas.GenerateRequest, {"prompt": "hi", "max_tokens": 7, "temperature": 0, "top_k": -1,
                                            "stop": ["\n"], "logit_bias": {"7": -100, "12": 2.5}, "n": 1,
                                            "tools": [], "logprobs": None, "request_id": "Ab9._:-x"}),
    ("/generate", schemas.GenerateRequest, {"input_ids": [1, 2, 3], "stream": True, "seed": 42,
                                            "response_format": {"type": "json_object"}}),
    ("/v1/completions", schemas.CompletionRequest, {"prompt": [[3, 4], "hi"], "n": 2, "echo": True, "logprobs": 2,
                                                    "stream": True, "stream_options": {"include_usage": True},
                                                    "metadata": {"team": "eval"}, "service_tier": "flex"}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}], "name": "x"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "min_p": 0.05}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {
        "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}, "strict": True}},
        "structured_outputs": None, "chat_template_kwargs": {"enable_thinking": False}}),
    ("/tokenize", schemas.TokenizeCompletionRequest, {"prompt": "x", "add_special_tokens": False}),
    ("/tokenize", schemas.TokenizeChatRequest, {"messages": USER, "add_generation_prompt": False}),
    ("/detokenize", schemas.DetokenizeRequest, {"tokens": [1, 2], "model": "m"}),
]

BAD = [
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "max_tokens": 0}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "max_tokens": True}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "max_tokens": "5"}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "top_p": 0}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "max_token": 5}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "n": 2}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "request_id": "a\n"}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "logit_bias": {"x": 1}}),
    ("/generate", schemas.GenerateRequest, {"prompt": "x", "response_format": {"type": "xml"}}),
    ("/v1/completions", schemas.CompletionRequest, {}),
    ("/v1/completions", schemas.CompletionRequest, {"prompt": ["a", ""]}),
    ("/v1/completions", schemas.CompletionRequest, {"prompt": "x", "n": 17}),
    ("/v1/completions", schemas.CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"foo": 1}}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {"messages": []}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {"messages": USER, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {"messages": USER, "service_tier": "gold"}),
    ("/v1/chat/completions", schemas.ChatCompletionRequest, {"messages": USER, "best_of": 2}),
    ("/tokenize", schemas.TokenizeCompletionRequest, {"prompt": 5}),
    ("/detokenize", schemas.DetokenizeRequest, {"tokens": "1 2"}),
]


@pytest.mark.parametrize(("path", "cls", "body"), GOOD)
def test_bodies_the_server_accepts_match_the_schema(path: str, cls: type[schemas.Body], body: dict) -> None:
    load(body, cls)
    validator(path).validate(body)


@pytest.mark.parametrize(("path", "cls", "body"), BAD)
def test_bodies_the_server_refuses_do_not_match_the_schema(path: str, cls: type[schemas.Body], body: dict) -> None:
    with pytest.raises(ApiError):
        load(body, cls)
    assert not validator(path).is_valid(body)


def test_forms_match_their_schema() -> None:
    form = {"file": "<the audio>", "max_tokens": 7, "language": "<|de|>", "task": "translate"}
    assert validator("/generate", "multipart/form-data").is_valid(form)
    assert not validator("/generate", "multipart/form-data").is_valid({**form, "prompt": "hi"})
    assert not validator("/generate", "multipart/form-data").is_valid({"max_tokens": 7})  # no file
    transcription = validator("/v1/audio/transcriptions", "multipart/form-data")
    assert transcription.is_valid({"file": "x", "response_format": "verbose_json", "temperature": 0.2})
    assert not transcription.is_valid({"file": "x", "response_format": "srt"})


def test_served_by_the_app(app) -> None:
    with TestClient(app) as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["paths"].keys() == DOC["paths"].keys() and got["components"] == DOC["components"]
