"""The one place a client request is checked (DESIGN.md sections 4 and 7).

Every route body is declared once as a msgspec Struct (`schemas.py`); `load` decodes a
request against it, so a bad request is a 400 naming the field and the limit, never a crash
or a silently dropped field further down. msgspec is strict as we want: a bool is not an
int, `"5"` is not a number, an unknown field is an error (`forbid_unknown_fields`), and a
field the engine cannot honour (`n` > 1 on `/generate`, `tools`, ...) is refused unless it
asks for nothing (`schemas.UNSUPPORTED`). `explain` turns msgspec's error ("Expected `int`
>= 1 - at `$.max_tokens`") into the usual ApiError: `param` is the field's path
(`messages[0].role`, `logit_bias["7"]`) and the message quotes the field's declared
requirement and the value the client sent.

What a Struct cannot say is checked here by hand, after decoding: rules across fields
(exactly one of `prompt` / `input_ids`, `min_tokens` <= `max_tokens`) and the fields'
translation into the frames' `SamplingParams` / `GenerateParams`. Limits only known at run
time stay where they are known: the vocabulary in `check_token_ids`, lengths (prompt +
max_tokens vs max_seq_len, max_tokens vs the decode loop's cap, footprint vs pool) in the
conductor, whose `RequestError` becomes the HTTP error.

Audio requests (`/generate` as multipart/form-data, `/v1/audio/transcriptions`) come as
form fields; `forms.py` turns each string into the JSON value it spells (`"5"` -> 5,
`"true"` -> true) and the same `load` runs on the result. Whether the audio itself decodes
(container, rate, length) is the data worker's check, not ours.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import re
import uuid
from collections.abc import Collection, Mapping
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, NamedTuple, TypeVar, Union, get_args, get_origin

import msgspec
from msgspec import Meta

from services.api.errors import ApiError, invalid
from services.api.schemas import INT32_MAX as INT32_MAX
from services.api.schemas import SEED_MAX as SEED_MAX
from services.api.schemas import (
    UNSUPPORTED,
    AudioGenerateForm,
    Body,
    ContextTurn,
    GenerateRequest,
    SamplingFields,
    TranscriptionForm,
    is_neutral,
)
from services.api.structured import parse_structured
from shared.errors import ErrorKind
from shared.frames import ContextTurn as ContextFrame
from shared.frames import SamplingParams
from shared.generation_config import SAMPLING

log = logging.getLogger("mstar.api")
B = TypeVar("B", bound=Body)
#: the request fields that become `SamplingParams` (every route names them alike)
SAMPLING_NAMES = tuple(SamplingFields.__struct_fields__)


class ImageRef(msgspec.Struct, frozen=True):
    """An image a request names: its URL, and the field's path for a 400 (a chat part's
    `messages[i].content[j].image_url.url`, `/generate`'s `images[i]`)."""

    url: str
    param: str


class AudioRef(msgspec.Struct, frozen=True):
    """An audio input a request names (omni models): its base64 data, and the field's path
    for a 400 (a chat part's `messages[i].content[j].input_audio.data`, `/generate`'s
    `audios[i]`)."""

    data: str
    param: str


class VideoRef(msgspec.Struct, frozen=True):
    """A video input a request names (omni models): its URL (a base64 data URL), and the
    field's path for a 400 (`messages[i].content[j].video_url.url`, `/generate`'s
    `videos[i]`)."""

    url: str
    param: str


class GenerateParams(msgspec.Struct, frozen=True, kw_only=True):
    """A validated `/generate` request (also what WebSocket `generate` frames become)."""

    request_id: str
    sampling: SamplingParams
    max_tokens: int | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    stream: bool | None = None  # None: the route's default (false for HTTP, true for WS)
    stop: list[str] = []  # stop strings, matched by the api on the detokenized text
    add_special_tokens: bool = True  # False for a chat-templated prompt (it holds its specials)
    #: the reply's text without special tokens (vLLM's default); a harmony chat keeps them
    skip_special_tokens: bool = True
    audio: bytes | None = None  # speech models: the uploaded WAV/FLAC file (then no prompt)
    language: str | None = None  # speech models: the language to force (None: the model's)
    task: str | None = None  # speech models: "transcribe" / "translate" (None: the model's)
    #: per-request model options for the data worker (`truncate_prompt_tokens`)
    options: dict[str, int | str | float | bool] = {}
    #: vision models: the images the request names, in prompt order, and (once the api
    #: fetched and checked them: `ApiState.load_images`) their files
    image_refs: tuple[ImageRef, ...] = ()
    images: tuple[bytes, ...] = ()
    #: omni models: the audio inputs the request names, in prompt order
    audio_refs: tuple[AudioRef, ...] = ()
    #: omni models: the video inputs the request names, in prompt order
    video_refs: tuple[VideoRef, ...] = ()
    #: speech models that continue a conversation (CSM): its earlier turns, audio decoded
    #: from base64 (the data worker decodes the files themselves)
    context: tuple[ContextFrame, ...] = ()
    #: robot policies: each image's camera (in the order of `images`), and the numeric
    #: inputs ("state", "noise" flattened) the data worker checks against the model
    cameras: tuple[str, ...] = ()
    floats: dict[str, list[float]] = {}
    #: the sampling fields the client left out, which take the model's defaults
    #: (generation_config.json) where it has them (`left_out`); None: the route takes none
    #: of them (max_tokens' default included)
    defaulted: frozenset[str] | None = None


# ---- decoding --------------------------------------------------------------------------------


def json_repr(value: Any, limit: int = 60) -> str:
    """The offending value as the client wrote it (JSON), shortened for the message."""
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, OverflowError, msgspec.EncodeError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode_json_object(body: bytes, what: str = "request body") -> dict[str, Any]:
    """Decode strict JSON (no NaN/Infinity, valid UTF-8) that must be an object."""
    if not body.strip():
        raise ApiError(ErrorKind.INVALID, f"{what} is empty; expected a JSON object")
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ApiError(ErrorKind.INVALID, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", NoneType: "null"}.get(type(obj), "a number")
        raise ApiError(ErrorKind.INVALID, f"{what} must be a JSON object, got {kind}")
    return obj


@functools.cache
def _names(cls: type[msgspec.Struct]) -> frozenset[str]:
    """The keys a body of `cls` may carry (its fields, and its tag's key)."""
    tag_field = cls.__struct_config__.tag_field
    return frozenset(f.encode_name for f in msgspec.structs.fields(cls)) | ({tag_field} if tag_field else set())


def _unknown(name: str, where: str, allowed: Collection[str], form: str = "") -> ApiError:
    place = f" in {where}" if where else form
    return invalid(f"{where}.{name}" if where else name,
                   f"unknown field {name!r}{place}; allowed fields: {', '.join(sorted(allowed))}")


def load(obj: Mapping[str, Any], cls: type[B], form: str = "") -> B:
    """`obj` (a decoded JSON object, or a form's typed fields) as the route body `cls`; raises
    ApiError (400). An unknown field is named before any other error; `form` says which form
    of a route's body the fields were checked against (`" with prompt"`)."""
    names = _names(cls)
    tolerated = [name for name in obj if name not in names]
    for name in tolerated:
        if name not in UNSUPPORTED or not cls.takes_unsupported:
            raise _unknown(name, "", names, form)
    for name in tolerated:
        if not is_neutral(name, obj[name]):
            raise invalid(name, f"{UNSUPPORTED[name][1]}, got {json_repr(obj[name])}")
    if tolerated:
        obj = {k: v for k, v in obj.items() if k in names}
    try:
        return msgspec.convert(obj, cls, str_keys=True)
    except msgspec.ValidationError as exc:
        try:
            err = explain(str(exc), obj, cls)
        except Exception:  # a bug here must not turn the client's 400 into a 500
            log.exception("could not explain %r for %s", str(exc), cls.__name__)
            err = ApiError(ErrorKind.INVALID, f"the request does not match {cls.__name__}: {exc}")
        raise err from None


# ---- msgspec's errors in the api's words --------------------------------------------------------

_MISSING = object()
_ERROR = re.compile(r"(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_EXPECTED = re.compile(r"Expected `(?P<type>[^`]+)`(?:, got `[^`]+`(?P<mismatch>)| of length (?P<lop>[<>]=?) \d+"
                       r"| (?P<op>[<>]=?) \S+| .*)?", re.S)
#: msgspec's names of JSON types -> the kinds of `_kind`
_KINDS = {"int": {"int"}, "float": {"float"}, "str": {"str", "enum"}, "bool": {"bool"}, "array": {"array"},
          "object": {"object"}, "null": {"null"}, "bytes": {"bytes"}}
_BOUNDS = {">=": "ge", ">": "gt", "<=": "le", "<": "lt"}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class _Node(NamedTuple):
    """A place in the body: its declared type (Annotated stripped), the Metas met on the
    way to it (outermost first), the client's value there, and its `param`."""

    tp: Any
    metas: tuple[Meta, ...]
    value: Any
    param: str


def _node(tp: Any, value: Any, param: str, metas: tuple[Meta, ...] = ()) -> _Node:
    while get_origin(tp) is Annotated:
        tp, *extras = get_args(tp)
        metas += tuple(m for m in extras if isinstance(m, Meta))
    return _Node(tp, metas, value, param)


def _options(node: _Node) -> list[_Node]:
    """The alternatives at `node`: a union's members (nested unions flattened, null left
    out), each with the Metas met on the way; else the node itself."""
    if get_origin(node.tp) not in (Union, UnionType):
        return [node]
    return [o for t in get_args(node.tp) if t is not NoneType
            for o in _options(_node(t, node.value, node.param, node.metas))]


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _kind(tp: Any) -> str:
    origin = get_origin(tp) or tp
    if origin is list:
        return "array"
    if origin is dict or _is_struct(tp):
        return "object"
    if origin is Literal:
        return "enum"
    return {int: "int", float: "float", str: "str", bool: "bool", bytes: "bytes", NoneType: "null"}.get(tp, "any")


def _pick(node: _Node, kinds: Collection[str] = ()) -> _Node:
    """The member of a union the error is about (the one of `kinds`; among tagged Structs,
    the one the value's tag names); else the union, with the Metas all its fitting members
    share (a description of the whole union)."""
    options = _options(node)
    fits = [o for o in options if _kind(o.tp) in kinds] or options
    structs = [o for o in fits if _is_struct(o.tp)]
    if len(structs) > 1 and isinstance(node.value, dict):
        tag_field = structs[0].tp.__struct_config__.tag_field
        fits = [o for o in structs if o.tp.__struct_config__.tag == node.value.get(tag_field)] or fits
    if len(fits) == 1:
        return fits[0]
    shared = 0
    while all(len(f.metas) > shared and f.metas[shared] is fits[0].metas[shared] for f in fits):
        shared += 1
    return node._replace(metas=fits[0].metas[:shared])


def _join(param: str, name: str) -> str:
    return f"{param}.{name}" if param else name


def _field(node: _Node, name: str) -> _Node:
    """The field `name` of the Struct at `node` (its tag, for a tagged union)."""
    value = node.value.get(name, _MISSING) if isinstance(node.value, dict) else _MISSING
    structs = [o.tp for o in _options(node) if _is_struct(o.tp)]
    if structs and structs[0].__struct_config__.tag_field == name:
        tags = ", ".join(str(s.__struct_config__.tag) for s in structs)
        return _Node(str, (Meta(description=f"one of {tags}"),), value, _join(node.param, name))
    cls = _pick(node, {"object"}).tp
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)} if _is_struct(cls) else {}
    return _node(fields[name].type if name in fields else Any, value, _join(node.param, name))


def _bad_key(node: _Node) -> Any:
    """The first key of the object at `node` whose entry does not decode (msgspec's path
    says `[...]` for a dict's value, without the key)."""
    for key, value in node.value.items():
        try:
            msgspec.convert({key: value}, node.tp, str_keys=True)
        except msgspec.ValidationError:
            return key
    return next(iter(node.value))


def _entry(node: _Node, of_key: bool) -> _Node:
    node = _pick(node, {"object"})
    key = _bad_key(node)
    key_tp, value_tp = get_args(node.tp)
    param = f"{node.param}[{json_repr(key)}]"
    return _node(key_tp, key, param) if of_key else _node(value_tp, node.value[key], param)


def _walk(root: _Node, path: str) -> _Node:
    node = root
    for name, index in _STEP.findall(path):
        if name:
            node = _field(node, name)
        elif index == "...":
            node = _entry(node, of_key=False)
        else:
            node = _pick(node, {"array"})
            i = int(index)
            node = _node(get_args(node.tp)[0], node.value[i], f"{node.param}[{i}]")
    return node


def _meta(node: _Node, attr: str) -> Any:
    """The innermost Meta's `attr` that is set."""
    for meta in reversed(node.metas):
        if getattr(meta, attr) is not None:
            return getattr(meta, attr)
    return None


def _generic(node: _Node) -> str:
    """The requirement of a node whose declaration has no description."""
    options = _options(node)
    if len(options) > 1:
        return " or ".join(dict.fromkeys(_generic(o) for o in options))
    node = options[0]
    kind = _kind(node.tp)
    if kind in ("int", "float"):
        word = "an integer" if kind == "int" else "a number"
        ge, gt = _meta(node, "ge"), _meta(node, "gt")
        return f"{word} >= {ge}" if ge is not None else f"{word} > {gt}" if gt is not None else word
    if kind in ("str", "array"):
        word = "string" if kind == "str" else "list"
        least = _meta(node, "min_length")
        return f"a non-empty {word}" if least == 1 else f"a {word} of length >= {least}" if least else f"a {word}"
    if kind == "enum":
        return "one of " + ", ".join(str(a) for a in get_args(node.tp))
    return {"bool": "a boolean", "object": "an object", "null": "null", "bytes": "bytes"}.get(kind, "a JSON value")


def _requirement(node: _Node) -> str:
    """What the field at `node` must be: its description, else the generic wording."""
    options = _options(node)
    node = options[0] if len(options) == 1 else node
    return _meta(node, "description") or _generic(node)


def _mentions(text: str, number: float) -> bool:
    return any((float(n) if "." in n else int(n)) == number for n in _NUMBER.findall(text))


def explain(message: str, obj: Mapping[str, Any], cls: type[Body]) -> ApiError:
    """msgspec's ValidationError `message` for `obj` decoded as `cls`, as a 400 whose param
    is the field's path and whose message names the field and its limit."""
    m = _ERROR.fullmatch(message)
    assert m is not None  # the pattern matches any text
    what, path = m["what"], m["path"] or ""
    node = _walk(_node(cls, obj, ""), path)
    if m["key"]:
        node = _entry(node, of_key=True)
    named = re.search(r"field `([^`]*)`", what)
    if what.startswith("Object contains unknown field") and named:
        return _unknown(named[1], node.param, _names(_pick(node, {"object"}).tp))
    if what.startswith("Object missing required field") and named:
        field = _field(node, named[1])
        return invalid(field.param, f"{field.param} is required: {_requirement(field)}")
    param, got = node.param, json_repr(node.value)
    expected = _EXPECTED.fullmatch(what)
    if expected is None:  # "Invalid enum value ...", "Number out of range", ...
        return invalid(param, f"{param} must be {_requirement(_pick(node, {'enum'}))}, got {got}")
    kinds = set().union(*(_KINDS.get(t, ()) for t in expected["type"].split(" | ")))
    if expected["mismatch"] is not None:
        return invalid(param, f"{param} must be {_requirement(_pick(node, kinds))}, got {got}")
    leaf = _pick(node, kinds)
    if expected["lop"] in ("<=", "<"):
        most = _meta(leaf, "max_length")
        if _kind(leaf.tp) == "str":
            return invalid(param, f"{param} must be at most {most} characters, got {len(node.value)}")
        noun = (_meta(leaf, "extra") or {}).get("noun", "items")
        return invalid(param, f"{param} must have at most {most} {noun}, got {len(node.value)}")
    requirement = _requirement(leaf)
    if expected["op"] and not m["key"]:  # a key's description is its requirement whatever the bound
        limit = _meta(leaf, _BOUNDS[expected["op"]])
        if limit is not None and not _mentions(requirement, limit):
            requirement = f"{'an integer' if _kind(leaf.tp) == 'int' else 'a number'} {expected['op']} {limit}"
    return invalid(param, f"{param} must be {requirement}, got {got}")


# ---- the fields the routes share -------------------------------------------------------------


def sampling_params(body: SamplingFields | TranscriptionForm, max_tokens: int | None = None, *,
                    grammar: str | None = None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The frame's SamplingParams from a decoded body (fields it does not declare, or leaves
    null, keep the frame's defaults); `max_tokens` as the client gave it (`min_tokens` may
    not exceed it). top_k -1 is normalised to 0, the frame's single "off" value."""
    given = {name: value for name in SAMPLING_NAMES if (value := getattr(body, name, None)) is not None}
    if given.get("top_k") == -1:
        given["top_k"] = 0
    if "stop_token_ids" in given:
        given["stop_token_ids"] = list(dict.fromkeys(given["stop_token_ids"]))
    min_tokens = given.get("min_tokens")
    if min_tokens and max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")
    extra: dict[str, Any] = {"grammar": grammar, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    return SamplingParams(**given, **{k: v for k, v in extra.items() if v is not None})


def left_out(body: SamplingFields) -> frozenset[str]:
    """The sampling fields a model's generation_config.json may set that `body` leaves out."""
    return frozenset(name for name in SAMPLING if getattr(body, name, None) is None)


def check_token_ids(sampling: SamplingParams, vocab_size: int) -> None:
    """logit_bias keys and stop_token_ids must be tokens of the model's vocabulary."""
    for name, ids in (("logit_bias", sampling.logit_bias), ("stop_token_ids", sampling.stop_token_ids)):
        for tok in ids:
            if tok >= vocab_size:
                raise invalid(name, f"{name} token id {tok} is out of the vocabulary "
                              f"(token ids are below {vocab_size})")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """`stop` (null, a string or a list) as the distinct stop strings, in order."""
    return [] if stop is None else [stop] if isinstance(stop, str) else list(dict.fromkeys(stop))


def new_request_id() -> str:
    return f"gen-{uuid.uuid4().hex}"


# ---- /generate --------------------------------------------------------------------------------


def generate_params(req: GenerateRequest) -> GenerateParams:
    """A decoded `/generate` body (or WebSocket `generate` frame) -> `GenerateParams`."""
    if req.prompt is None and req.input_ids is None:
        raise invalid("prompt", "one of prompt (a string) or input_ids (a list of integers) is required")
    if req.prompt is not None and req.input_ids is not None:
        raise invalid("input_ids", "prompt and input_ids are mutually exclusive; give exactly one")
    sampling = sampling_params(req, req.max_tokens, grammar=parse_structured(req), logprobs=req.logprobs,
                               prompt_logprobs=req.prompt_logprobs)
    images = tuple(ImageRef(url, f"images[{i}]") for i, url in enumerate(req.images or ()))
    audios = tuple(AudioRef(data, f"audios[{i}]") for i, data in enumerate(req.audios or ()))
    videos = tuple(VideoRef(url, f"videos[{i}]") for i, url in enumerate(req.videos or ()))
    if req.context and req.input_ids is not None:
        raise invalid("input_ids", "context turns need a text prompt (the turn to speak), not input_ids")
    return GenerateParams(request_id=req.request_id or new_request_id(), sampling=sampling, max_tokens=req.max_tokens,
                          prompt=req.prompt, input_ids=req.input_ids, stream=req.stream, stop=stop_strings(req.stop),
                          image_refs=images, audio_refs=audios, video_refs=videos, context=context_turns(req.context),
                          defaulted=left_out(req))


def context_turns(turns: list[ContextTurn] | None) -> tuple[ContextFrame, ...]:
    """The body's context turns as the data worker takes them: each audio's file bytes
    from its base64 (a `data:` URL's payload too); a 400 naming `context[i].audio` for
    text that is not base64, `context[i].text` for a turn with neither (a turn may be a
    clip alone: a Qwen3-TTS Base checkpoint's reference; each family's spec says what its
    turns need)."""
    out = []
    for i, turn in enumerate(turns or ()):
        audio = None
        if turn.audio is not None:
            text = turn.audio.split(",", 1)[1] if turn.audio.startswith("data:") and "," in turn.audio else turn.audio
            try:
                audio = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise invalid(f"context[{i}].audio", f"context[{i}].audio is not base64 (a WAV or FLAC file's "
                                                     "bytes, base64-encoded)") from None
            if not audio:
                raise invalid(f"context[{i}].audio", f"context[{i}].audio is empty")
        if not turn.text and audio is None:
            raise invalid(f"context[{i}].text", f"context[{i}] has neither text nor audio")
        out.append(ContextFrame(turn.speaker, turn.text, audio))
    return tuple(out)


def parse_generate(obj: Mapping[str, Any]) -> GenerateParams:
    """Validate a `/generate` body into `GenerateParams`; raises `ApiError`."""
    return generate_params(load(obj, GenerateRequest))


def check_audio(audio: bytes | None, name: str = "file") -> bytes:
    """The uploaded file must be there and non-empty (decoding it is the data worker's job)."""
    if audio is None:
        raise invalid(name, f"{name} is required: upload a WAV or FLAC file as the multipart/form-data field {name!r}")
    if not audio:
        raise invalid(name, f"{name} is empty; upload a WAV or FLAC file")
    return audio


def parse_audio_generate(obj: Mapping[str, Any], audio: bytes | None) -> GenerateParams:
    """Validate the fields of a multipart `/generate` (already typed by `forms.py`) that
    carries an audio file (`schemas.AudioGenerateForm`)."""
    req = load(obj, AudioGenerateForm)
    sampling = sampling_params(req, req.max_tokens, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)
    return GenerateParams(request_id=req.request_id or new_request_id(), sampling=sampling, max_tokens=req.max_tokens,
                          stream=req.stream, stop=stop_strings(req.stop), audio=check_audio(audio),
                          language=req.language, task=req.task, defaulted=left_out(req))
