"""OpenAI's Responses API through real services, with the official `openai` SDK
(`responses.create`, `.stream`, `.parse`, `.retrieve`, `.delete`) and OpenAI's Agents SDK
(`Runner.run_sync` with a `@function_tool`): text on the default model (SmolLM2, the same
greedy text as `/v1/chat/completions` for the same conversation), function tools on a tiny
random checkpoint with a hermes tool template (forced calls are grammar-enforced, so they
parse and validate), `previous_response_id` chaining, the store's routes, refusals, and a
restart of the api losing what it stored (a 404 naming the id)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.checkpoints import make_checkpoint
from tests.e2e.test_tools import HERMES_TEMPLATE
from tests.servers import MstarServer

ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
               "additionalProperties": False}, "strict": True}
#: OpenAI's stream for one text answer
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def squeeze(types: list[str]) -> list[str]:
    """Event types with runs of one delta type shown once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


@pytest.fixture(scope="module")
def smol(smollm_server) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A tiny random Llama served with a hermes tool template (the last test restarts it)."""
    folder = tmp_path_factory.mktemp("responses")
    ckpt = make_checkpoint(folder / "tiny-llama", "llama", max_position_embeddings=4096)
    (folder / "template.jinja").write_text(HERMES_TEMPLATE)
    server = MstarServer(str(ckpt), folder / "log.txt", "--num-kv-pages", "512",
                         "--chat-template", str(folder / "template.jinja")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny(tiny_server) -> tuple[MstarServer, str]:
    """(the server, its model name); through `tiny_server`, pages_back_to_zero checks it."""
    return tiny_server, tiny_client(tiny_server).models.list().data[0].id


def tiny_client(server: MstarServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


# ---- text on the default model ----------------------------------------------------------------


def test_create_gives_the_same_text_as_chat_for_the_same_conversation(smol):
    client, model = smol
    resp = client.responses.create(model=model, instructions="Answer in one sentence.", input=ASK,
                                   max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": ASK}])
    assert resp.output_text == chat.choices[0].message.content and "Paris" in resp.output_text
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == model
    assert [(o.type, o.role, o.id[:4]) for o in resp.output] == [("message", "assistant", "msg_")]
    assert resp.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert (resp.instructions, resp.temperature, resp.max_output_tokens) == ("Answer in one sentence.", 0.0, 24)


def test_stream_deltas_join_to_the_final_text_in_openais_event_order(smol):
    client, model = smol
    types, deltas, seqs = [], [], []
    with client.responses.stream(model=model, input=ASK, max_output_tokens=40, temperature=0) as stream:
        for event in stream:
            types.append(event.type)
            seqs.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    whole = client.responses.create(model=model, input=ASK, max_output_tokens=40, temperature=0)
    assert squeeze(types) == [*TEXT_EVENTS[:-1], f"response.{final.status}"]
    assert seqs == list(range(len(seqs)))
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == whole.output_text
    assert final.usage == whole.usage


def test_max_output_tokens_makes_an_incomplete_response(smol):
    client, model = smol
    resp = client.responses.create(model=model, input=ASK, max_output_tokens=3, temperature=0)
    assert (resp.status, resp.incomplete_details.reason, resp.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 3)
    types = [e.type for e in client.responses.create(model=model, input=ASK, max_output_tokens=3, temperature=0,
                                                     stream=True)]
    assert types[-1] == "response.incomplete"


def test_parse_fills_a_pydantic_model(smol):
    client, model = smol

    class City(BaseModel):
        name: str = Field(max_length=16)
        population: int = Field(ge=0, le=10_000_000)

    resp = client.responses.parse(model=model, input="Name a city and its population, as JSON.", text_format=City,
                                  max_output_tokens=60, temperature=0)
    assert isinstance(resp.output_parsed, City)
    assert City.model_validate_json(resp.output_text) == resp.output_parsed


def test_previous_response_id_sends_the_earlier_turn(smol):
    client, model = smol
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=12, temperature=0)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    explicit = client.responses.create(model=model, max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    alone = client.responses.create(model=model, input="What is my name?", max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens > alone.usage.input_tokens + 5
    third = client.responses.create(model=model, input="Say it again.", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_stored_responses_can_be_read_and_deleted(smol):
    client, model = smol
    resp = client.responses.create(model=model, input=ASK, max_output_tokens=8, temperature=0,
                                   metadata={"k": "v"})
    got = client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()
    deleted = httpx.delete(f"{client.base_url}responses/{resp.id}")
    assert deleted.json() == {"id": resp.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(resp.id)
    assert info.value.body["message"] == f"Response with id '{resp.id}' not found."
    unstored = client.responses.create(model=model, input=ASK, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    cancel = httpx.post(f"{client.base_url}responses/{got.id}/cancel")
    assert cancel.status_code == 404  # deleted above
    kept = client.responses.create(model=model, input=ASK, max_output_tokens=2)
    cancel = httpx.post(f"{client.base_url}responses/{kept.id}/cancel")
    assert cancel.status_code == 400 and "background=true" in cancel.json()["error"]["message"]


def test_an_unknown_previous_response_id_is_a_404_naming_it(smol):
    client, model = smol
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, input="hi", previous_response_id="resp_never")
    assert info.value.body == {"message": "Response with id 'resp_never' not found.", "type": "invalid_request_error",
                               "param": "previous_response_id", "error_id": None,
                               "code": "previous_response_not_found"}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", '"web_search" is not supported'),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": []}]},
     "tools[1].type", '"file_search" is not supported'),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_audio"}]}]},
     "input[0].content[0].type", "must be one of input_text"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "is required"),
    ({"input": [{"role": "user"}]}, "input[0].content", "is required"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
     "text.format.schema", "does not compile"),
    ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty", "unknown field"),
])
def test_bad_requests_are_400s_naming_the_field(smol, body, param, words):
    client, _ = smol
    r = httpx.post(f"{client.base_url}responses", json=body, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    assert words in r.json()["error"]["message"]


# ---- tools on the tiny hermes checkpoint ------------------------------------------------------


def test_a_forced_call_round_trip(tiny):
    server, model = tiny
    client = tiny_client(server)
    ask = "What is the weather in Paris?"
    first = client.responses.create(model=model, input=ask, tools=[WEATHER], max_output_tokens=200, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in first.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and first.status == "completed"
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    second = client.responses.create(model=model, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                     max_output_tokens=8, temperature=0)
    explicit = client.responses.create(model=model, input=[{"role": "user", "content": ask},
                                                           *[o.model_dump(exclude_none=True) for o in first.output],
                                                           result],
                                       tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens + 10
    assert [o.type for o in second.output] == [o.type for o in explicit.output]
    assert second.output_text == explicit.output_text


def test_a_streamed_call_equals_the_unstreamed_one(tiny):
    server, model = tiny
    client = tiny_client(server)
    kw = {"model": model, "input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": "required",
          "max_output_tokens": 200, "temperature": 0}
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    per_call = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done"]
    assert types[2:-1] == per_call * len(whole.output)
    assert [(o.type, o.name, o.arguments) for o in final.output] == [(o.type, o.name, o.arguments)
                                                                     for o in whole.output]


def test_the_agents_sdk_runs_a_tool_round_trip(smol):
    """The first turn is forced to call (tool_choice required: the grammar), the SDK runs the
    tool and sends its result back (tool_choice reset to auto, the earlier output replayed as
    input items), and the model answers in text."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    client, model = smol
    set_tracing_disabled(True)
    seen: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        seen.append((city, unit))
        return f"21 degrees {unit} in {city}"

    aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x", max_retries=0, timeout=60)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=model, openai_client=aclient),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=100))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(seen) == 1 and seen[0][0] == "Paris"
    assert [type(i) for i in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert len(result.raw_responses) == 2  # the call, then the answer to its result
    answer = result.raw_responses[1].output[-1]
    assert answer.type == "message" and result.final_output == answer.content[0].text


def test_a_restart_of_the_api_forgets_stored_responses(tiny):
    server, model = tiny
    client = tiny_client(server)
    kept = client.responses.create(model=model, input="hello", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).id == kept.id
    server.stop()
    server.start()
    client = tiny_client(server)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(kept.id)
    assert info.value.body["message"] == f"Response with id '{kept.id}' not found."
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, input="again", previous_response_id=kept.id, max_output_tokens=2)
    assert (info.value.body["param"], info.value.body["message"]) == (
        "previous_response_id", f"Response with id '{kept.id}' not found.")
