"""What agents send, as a new user tries it (issue 48): structured outputs through the
`openai` SDK's `parse()` (five schemas: integers, enums, nested objects, bounded lists), forced
tool calls whose function leaves its object open (no `additionalProperties`), and JSON mode.
Each case counts as passed only when the reply parses and validates. The e2e test runs them
on mstar; `python -m bench agents` runs the same cases against llama-server side by side.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import jsonschema
import openai
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0)


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]
    temperature: int


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    address: Address


class Recipe(BaseModel):
    title: str
    ingredients: list[str] = Field(min_length=1, max_length=5)
    minutes: int = Field(ge=1)


class Review(BaseModel):
    product: str
    rating: int = Field(ge=1, le=5)
    sentiment: Literal["positive", "negative", "neutral"]
    tags: list[str] = Field(max_length=3)


#: (schema, what the user asks) for `parse()`
PARSE_CASES: list[tuple[type[BaseModel], str]] = [
    (City, "Describe Paris as JSON: its name, country and population."),
    (Weather, "What is the weather like in Oslo today? Answer as JSON."),
    (Person, "Invent a person with a name, an age and a home address, as JSON."),
    (Recipe, "Give me a simple pancake recipe as JSON."),
    (Review, "Write a short review of a pair of running shoes as JSON."),
]

#: llama.cpp's and vLLM's users' usual search tool, its object left open as most write it
WEB_SEARCH = {"type": "function", "function": {
    "name": "web_search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query"]}}}
TOOL_PROMPTS = ["Search the web for the population of Paris.", "Find recent news about the Mars rover.",
                "Look up the best pancake recipe online."]
JSON_PROMPTS = ["List three fruits and their colours as a JSON object.", "Describe a cat as a JSON object.",
                "Give me a JSON object with the name and age of a fictional person."]
MAX_TOKENS = 300


class Outcome(BaseModel):
    case: str
    ok: bool
    detail: str = ""


def _run(case: str, fn: Callable[[], str]) -> Outcome:
    """One case: passed, or why not (the SDK's error, a schema that did not validate)."""
    try:
        return Outcome(case=case, ok=True, detail=fn())
    except (openai.OpenAIError, jsonschema.ValidationError, ValueError, AssertionError) as exc:
        return Outcome(case=case, ok=False, detail=f"{type(exc).__name__}: {str(exc)[:200]}")


def parse_case(client: openai.OpenAI, model: str, schema: type[BaseModel], ask: str) -> Outcome:
    def go() -> str:
        done = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": ask}],
                                             response_format=schema, temperature=0, max_tokens=MAX_TOKENS)
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, schema), done.choices[0].message.content
        return parsed.model_dump_json()

    return _run(f"parse {schema.__name__}", go)


def tool_case(client: openai.OpenAI, model: str, ask: str) -> Outcome:
    """A forced call of `web_search`: one call, its arguments only the declared keys and valid."""
    def go() -> str:
        done = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ask}], tools=[WEB_SEARCH],
            tool_choice={"type": "function", "function": {"name": "web_search"}}, temperature=0,
            max_tokens=MAX_TOKENS)
        calls = done.choices[0].message.tool_calls
        assert calls and len(calls) == 1 and calls[0].function.name == "web_search", done.choices[0]
        args: dict[str, Any] = json.loads(calls[0].function.arguments)
        jsonschema.validate(args, WEB_SEARCH["function"]["parameters"])
        assert set(args) <= {"query", "limit"}, f"undeclared keys {sorted(set(args) - {'query', 'limit'})}"
        return calls[0].function.arguments

    return _run(f"tool {ask[:24]}", go)


def json_case(client: openai.OpenAI, model: str, ask: str) -> Outcome:
    def go() -> str:
        done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ask}],
                                              response_format={"type": "json_object"}, temperature=0,
                                              max_tokens=MAX_TOKENS)
        text = done.choices[0].message.content or ""
        assert done.choices[0].finish_reason == "stop", f"finish_reason {done.choices[0].finish_reason}: {text[:80]}"
        assert isinstance(json.loads(text), dict), text
        return text

    return _run(f"json_object {ask[:24]}", go)


def langchain_cases(base_url: str, model: str) -> list[Outcome]:
    """LangChain's `with_structured_output(City)` and `bind_tools([web_search])` forced."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=base_url, api_key="x", temperature=0, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                     max_retries=0)

    def structured() -> str:
        city = llm.with_structured_output(City).invoke("Describe Paris: its name, country and population.")
        assert isinstance(city, City), city
        return city.model_dump_json()

    def tools() -> str:
        msg = llm.bind_tools([WEB_SEARCH], tool_choice="web_search").invoke(TOOL_PROMPTS[0])
        calls = getattr(msg, "tool_calls", [])
        assert [c["name"] for c in calls] == ["web_search"], msg
        jsonschema.validate(calls[0]["args"], WEB_SEARCH["function"]["parameters"])
        assert set(calls[0]["args"]) <= {"query", "limit"}, calls[0]["args"]
        return json.dumps(calls[0]["args"])

    return [_run("langchain with_structured_output City", structured), _run("langchain bind_tools", tools)]


def all_cases(base_url: str, model: str | None = None) -> list[Outcome]:
    """Every case against the OpenAI-compatible server at `base_url` (…/v1)."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    model = model or client.models.list().data[0].id
    out = [parse_case(client, model, schema, ask) for schema, ask in PARSE_CASES]
    out += [tool_case(client, model, ask) for ask in TOOL_PROMPTS]
    out += [json_case(client, model, ask) for ask in JSON_PROMPTS]
    return out + langchain_cases(base_url, model)
