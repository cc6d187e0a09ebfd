"""Structured outputs through real services and the official openai client (issue 30): the
SDK's `parse()` with nested Pydantic models returns a `parsed` object that validates, on a
random-weight checkpoint (whose free text is noise: only the grammar makes it JSON) and on
the default model; `json_object` replies parse; `regex` output full-matches; `choice`
output is one of the choices; a constrained request batches with free ones; a schema
llguidance cannot enforce is a 400 naming the field and the keyword."""

from __future__ import annotations

import asyncio
import enum
import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field


class Color(enum.StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Item(BaseModel):
    name: str = Field(max_length=12)
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)
    color: Color
    note: str | None = Field(default=None, max_length=10)
    rush: bool


MESSAGES = [{"role": "user", "content": "Order two apples and a pear, in green. Reply in JSON."}]


def _parse(client: openai.OpenAI, model: str) -> Order:
    done = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Order, max_tokens=300,
                                         temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Order)
    return Order.model_validate_json(choice.message.content)  # the text itself validates too


def test_parse_with_nested_pydantic_models_on_a_random_checkpoint(client, model):
    order = _parse(client, model)
    assert 1 <= len(order.items) <= 3 and all(1 <= i.qty <= 9 for i in order.items)


def test_json_object_replies_parse(client, model):
    done = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, temperature=0,
                                          response_format={"type": "json_object"})
    choice = done.choices[0]
    if choice.finish_reason == "stop":  # an object any size: a random model may not close it in 200 tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


def test_regex_and_choice_on_completions_and_generate(client, model, llama_server):
    done = client.completions.create(model=model, prompt="My email is", max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[a-z]{1,8}@[a-z]{1,8}\\.(com|org)"}})
    assert re.fullmatch(r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", done.choices[0].text), done.choices[0].text
    for body in ({"guided_choice": ["alpha", "beta", "gamma"]},
                 {"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}):
        r = httpx.post(llama_server.url + "/generate",
                       json={"prompt": "Pick one:", "max_tokens": 10, "temperature": 0.9, "seed": 3, **body},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["text"] in ("alpha", "beta", "gamma") and r.json()["finish_reason"] == "stop"


async def test_constrained_requests_batch_with_free_ones(llama_server):
    """Eight requests at once, every other one constrained: each constrained output full-
    matches its regex, and each free one equals what it gives alone."""
    url = llama_server.url + "/generate"
    free = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(url, json=free, timeout=60).json()["token_ids"]
    async with httpx.AsyncClient(timeout=120) as c:
        bodies = [free if i % 2 else {"prompt": f"code {i}:", "max_tokens": 12, "temperature": 0,
                                      "guided_regex": "[0-9]{4}-[A-Z]{2}"} for i in range(8)]
        replies = await asyncio.gather(*(c.post(url, json=b) for b in bodies))
    for i, r in enumerate(replies):
        assert r.status_code == 200, r.text
        if i % 2:
            assert r.json()["token_ids"] == alone
        else:
            assert re.fullmatch(r"[0-9]{4}-[A-Z]{2}", r.json()["text"]), r.json()["text"]
    assert llama_server.wait_pages_free() == 0


def test_a_keyword_llguidance_cannot_enforce_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        schema = {"type": "object", "not": {"required": ["a"]}}
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    err = info.value.body
    assert err["param"] == "response_format.json_schema.schema"
    assert 'Unimplemented keys: ["not"]' in err["message"]


def test_parse_on_the_default_model(smollm_server):
    client = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    order = _parse(client, model)
    assert order.items


async def test_generate_ws_takes_a_constraint_per_request(llama_server):
    import websockets

    url = llama_server.url.replace("http://", "ws://") + "/generate/ws"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "c", "prompt": "Pick:", "max_tokens": 8,
                                  "guided_choice": ["left", "right"]}))
        await ws.send(json.dumps({"type": "generate", "id": "bad", "prompt": "x", "guided_regex": "(unclosed"}))
        frames = {}
        while len(frames) < 2:
            f = json.loads(await ws.recv())
            if f["type"] in ("done", "error"):
                frames[f["id"]] = f
    assert frames["c"]["type"] == "done" and frames["c"]["text"] in ("left", "right")
    assert frames["bad"]["type"] == "error" and frames["bad"]["error"]["param"] == "guided_regex"
