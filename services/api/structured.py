"""Structured outputs: the request fields that constrain what a model may write, compiled
to one llguidance grammar that the gpu worker's sampler enforces token by token.

Accepted, at most one per request (each is a 400 naming the field when it is malformed or
does not compile, with llguidance's reason):
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, object or string), `regex`, `choice`
  (a list of strings), `grammar` (Lark, or GBNF / EBNF with `::=`), `json_object: true`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

The grammar is llguidance's own (`LLMatcher.grammar_from_*`): the api compiles and checks it
once, and the frame carries the compiled text, so the worker never sees a request field.
JSON schemas are compiled strictly: a keyword llguidance cannot enforce is refused by name,
never ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from services.api.errors import invalid

#: the request fields this module reads (the routes accept them)
STRUCTURED_FIELDS: frozenset[str] = frozenset(
    {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"})
#: the keys of vLLM's `structured_outputs` that name a constraint
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: vLLM's options beside them that change nothing here
STRUCTURED_NEUTRAL = frozenset({"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                                "whitespace_pattern", "backend"})
MAX_CHOICES = 1024
#: JSON the model writes is compact-friendly but may use whitespace as the schema allows
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def _llg():
    import llguidance

    return llguidance.LLMatcher



def _schema(value: Any, param: str) -> dict[str, Any] | bool:
    """A JSON schema given as an object, a boolean, or a JSON string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(param, f"{param} must be a JSON schema (an object); its string is not JSON: {exc}") from None
    if not isinstance(value, dict | bool):
        raise invalid(param, f"{param} must be a JSON schema (an object), got {type(value).__name__}")
    return value


def _from_schema(schema: dict[str, Any] | bool, param: str) -> str:
    try:
        return _llg().grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise invalid(param, f"{param} is not a usable JSON schema: {exc}") from None


def _from_regex(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(param, f"{param} must be a non-empty string (a regular expression)")
    return _llg().grammar_from_regex(value)


def _from_choice(value: Any, param: str) -> str:
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)):
        raise invalid(param, f"{param} must be a list of 1 to {MAX_CHOICES} non-empty strings")
    # a Lark rule of string literals (JSON strings are valid Lark literals)
    return _llg().grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(value)))


def _from_grammar(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid(param, f"{param} must be a non-empty string (a Lark grammar, or GBNF with ::=)")
    if "::=" in value:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            value = gbnf_to_lark(value)
        except Exception as exc:  # the converter's own parse error
            raise invalid(param, f"{param} is not a valid GBNF grammar: {exc}") from None
    return _llg().grammar_from_lark(value)


def _response_format(value: Any) -> tuple[str, str] | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(param, 'response_format must be an object with "type": "text", "json_object" or "json_schema"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _from_schema({"type": "object"}, param), param
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("response_format.json_schema",
                       'response_format.json_schema must be an object with "name" and "schema"')
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid("response_format.json_schema.strict", "response_format.json_schema.strict must be a boolean")
        param = "response_format.json_schema.schema"
        return _from_schema(_schema(spec["schema"], param), param), param
    raise invalid(param, f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}')


def _structured_outputs(value: Any) -> tuple[str, str] | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid(param, f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KINDS)}")
    unknown = sorted(set(value) - set(STRUCTURED_KINDS) - STRUCTURED_NEUTRAL)
    if unknown:
        raise invalid(f"structured_outputs.{unknown[0]}",
                   f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(STRUCTURED_KINDS)}")
    kinds = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid(param, f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}, "
                          f"got {kinds or 'none'}")
    kind = kinds[0]
    param = f"structured_outputs.{kind}"
    return _compile(kind, value[kind], param), param


def _compile(kind: str, value: Any, param: str) -> str:
    if kind == "json":
        return _from_schema(_schema(value, param), param)
    if kind == "json_object":
        if value is not True:
            raise invalid(param, f"{param} must be true")
        return _from_schema({"type": "object"}, param)
    if kind == "regex":
        return _from_regex(value, param)
    if kind == "choice":
        return _from_choice(value, param)
    return _from_grammar(value, param)


def validated(grammar: str, param: str) -> str:
    """`grammar` if llguidance compiles it, else a 400 naming `param` with its reason."""
    error, messages = _llg().validate_grammar_with_warnings(grammar)
    if error:
        raise invalid(param, f"{param} does not compile: {messages[0] if messages else 'unknown error'}")
    return grammar


def parse_structured(obj: Mapping[str, Any]) -> str | None:
    """The llguidance grammar the request's structured-output fields ask for (None: none),
    compiled and checked; raises `ApiError` (400) naming the field."""
    found: list[tuple[str, str]] = []
    if obj.get("response_format") is not None:
        got = _response_format(obj["response_format"])
        if got is not None:
            found.append(got)
    if obj.get("structured_outputs") is not None:
        got = _structured_outputs(obj["structured_outputs"])
        if got is not None:
            found.append(got)
    for kind in ("json", "regex", "choice", "grammar"):
        name = f"guided_{kind}"
        if obj.get(name) is not None:
            found.append((_compile(kind, obj[name], name), name))
    if not found:
        return None
    if len(found) > 1:
        names = [p.split(".")[0] for _, p in found]
        raise invalid(names[1], f"only one structured-output constraint may be set per request, got {', '.join(names)}")
    grammar, param = found[0]
    return validated(grammar, param)
