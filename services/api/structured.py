"""Structured outputs: the request fields that constrain what a model may write, compiled
to one llguidance grammar that the gpu worker's sampler enforces token by token.

Accepted, at most one per request (their shapes are declared in `schemas.py`; a value that
does not compile is a 400 naming the field, with llguidance's reason):
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, object or string), `regex`, `choice`
  (a list of strings), `grammar` (Lark, or GBNF / EBNF with `::=`), `json_object: true`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

The grammar is llguidance's own (`LLMatcher.grammar_from_*`): the api compiles and checks it
once, and the frame carries the compiled text, so the worker never sees a request field.
JSON schemas are compiled strictly: a keyword llguidance cannot enforce is refused by name,
never ignored. Before compiling, a schema gets the defaults llama.cpp's schema converter
and vLLM's strict backends give (`tightened`), so a small model cannot run away inside it:
- an object that declares `properties` is closed to them unless it says otherwise
  (`additionalProperties` or `patternProperties` given; `true` reopens it); an object with
  no `properties` (`{"type": "object"}`, `json_object`) stays open;
- an integer without a bound in some direction gets one of 16 digits (|n| < 10^16, as
  llama.cpp's `integral-part` allows; a bound the schema gives is kept), and a number's
  integer part likewise.
"""

from __future__ import annotations

import json
from typing import Any, cast

from services.api.errors import invalid
from services.api.schemas import (
    ConstrainedFields,
    JsonObjectFormat,
    JsonSchemaFormat,
    StructuredOutputs,
    TextFormat,
)

#: the keys of vLLM's `structured_outputs` that name a constraint
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: between two JSON tokens at most one space, or a newline and an indent of up to 20: the
#: `space` rule of llama.cpp's converter. Models write `{"a": 1}` and pretty-printed JSON as
#: they learned it (forced into compact JSON, SmolLM2 ran away in a third of the cases the
#: agents test asks), and a bounded gap cannot be padded forever.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": True, "whitespace_pattern": r"(?:[ ]|\n[ \t]{0,20})?"}


#: the most digits an unbounded integer may have (llama.cpp's converter allows 16)
INTEGER_DIGITS = 16
_INT_LIMIT = 10**INTEGER_DIGITS - 1
#: keywords whose value is one subschema, a list of them, or a name -> subschema map
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _is(schema: dict[str, Any], kind: str) -> bool:
    t = schema.get("type")
    return t == kind or (isinstance(t, list) and kind in t)


def _bound(schema: dict[str, Any], limit: int | float) -> None:
    """An integer's (or a number's integer part's) range, where the schema leaves a side open."""
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = limit
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -limit


def tightened(schema: Any, closable: bool = True) -> Any:
    """A copy of `schema` with the defaults above; `closable` is false for the members of an
    `allOf`, whose properties are merged (closing each would refuse the others')."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = (tightened(out[key]) if not isinstance(out[key], list)
                        else [tightened(s) for s in out[key]])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [tightened(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [tightened(s, closable=False) for s in out["allOf"]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: tightened(s) for name, s in out[key].items()}
    has_type = "type" in out
    if (closable and isinstance(out.get("properties"), dict) and (not has_type or _is(out, "object"))
            and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys()):
        out["additionalProperties"] = False
    if "enum" not in out and "const" not in out:
        if _is(out, "integer") and not _is(out, "number"):
            _bound(out, _INT_LIMIT)
        elif _is(out, "number"):
            _bound(out, float(_INT_LIMIT + 1))
    return out


def _llg():
    import llguidance

    return llguidance.LLMatcher


def _schema(value: dict[str, Any] | bool | str, param: str) -> dict[str, Any] | bool:
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
        return _llg().grammar_from_json_schema(tightened(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise invalid(param, f"{param} is not a usable JSON schema: {exc}") from None


def _from_grammar(value: str, param: str) -> str:
    if "::=" in value:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            value = gbnf_to_lark(value)
        except Exception as exc:  # the converter's own parse error
            raise invalid(param, f"{param} is not a valid GBNF grammar: {exc}") from None
    return _llg().grammar_from_lark(value)


def _compile(kind: str, value: Any, param: str) -> str:
    """The grammar of one constraint, its value already of the declared type."""
    if kind == "json":
        return _from_schema(_schema(value, param), param)
    if kind == "json_object":
        return _from_schema({"type": "object"}, param)
    if kind == "regex":
        return _llg().grammar_from_regex(value)
    if kind == "choice":  # a Lark rule of string literals (JSON strings are valid Lark literals)
        return _llg().grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(value)))
    return _from_grammar(value, param)


def _response_format(value: TextFormat | JsonObjectFormat | JsonSchemaFormat) -> tuple[str, str] | None:
    kind = type(value).__struct_config__.tag
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile("json_object", True, "response_format"), "response_format"
    param = "response_format.json_schema.schema"
    return _compile("json", cast("JsonSchemaFormat", value).json_schema.schema, param), param


def _structured_outputs(value: StructuredOutputs) -> tuple[str, str]:
    kinds = [k for k in STRUCTURED_KINDS if getattr(value, k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid("structured_outputs", "structured_outputs must set exactly one of "
                      f"{', '.join(STRUCTURED_KINDS)}, got {kinds or 'none'}")
    param = f"structured_outputs.{kinds[0]}"
    return _compile(kinds[0], getattr(value, kinds[0]), param), param


def validated(grammar: str, param: str) -> str:
    """`grammar` if llguidance compiles it, else a 400 naming `param` with its reason."""
    error, messages = _llg().validate_grammar_with_warnings(grammar)
    if error:
        raise invalid(param, f"{param} does not compile: {messages[0] if messages else 'unknown error'}")
    return grammar


def parse_structured(req: ConstrainedFields) -> str | None:
    """The llguidance grammar a decoded body's structured-output fields ask for (None:
    none), compiled and checked; raises `ApiError` (400) naming the field."""
    found: list[tuple[str, str]] = []
    if req.response_format is not None and (got := _response_format(req.response_format)) is not None:
        found.append(got)
    if req.structured_outputs is not None:
        found.append(_structured_outputs(req.structured_outputs))
    for kind in ("json", "regex", "choice", "grammar"):
        name = f"guided_{kind}"
        if getattr(req, name) is not None:
            found.append((_compile(kind, getattr(req, name), name), name))
    if not found:
        return None
    if len(found) > 1:
        names = [p.split(".")[0] for _, p in found]
        raise invalid(names[1], f"only one structured-output constraint may be set per request, got {', '.join(names)}")
    grammar, param = found[0]
    return validated(grammar, param)
