"""multipart/form-data bodies (audio uploads) -> the object a JSON body would decode to.

`/generate` with a file and `/v1/audio/transcriptions` send their fields as a form. This
module only reads the form; the checks are `validation.py`'s, run on what `parse_form`
returns, so a form field and a JSON field are checked one way:
- the `file` part's bytes are kept as sent (with or without a filename: `curl -F
  file=@a.wav` and `-F file=<a.wav` both work);
- every other part is UTF-8 text, read as the JSON value it spells when it is one (`"5"`
  -> 5, `"0.5"` -> 0.5, `"true"` -> true, `"null"` -> null), else kept as the string, so
  `max_tokens=abc` is refused by the validator with its usual message (`got "abc"`);
  fields whose value is text (`TEXT_FIELDS`: `prompt`, `language`, `stop`, ...) are never
  read as JSON (`request_id=123` is the string "123");
- an empty value is the same as an absent field (JSON's null);
- only `stop` may repeat (`-F stop=a -F stop=b` is `["a", "b"]`); any other field given
  twice is a 400;
- a route whose files have other names (`/v1/images/edits`: `image`, `image[]`, `mask`)
  names them (`file_fields`): their parts are kept as bytes, in order, each name's list
  in `Form.files`, and may repeat.

The body is read whole first (`serving.read_body`, so the api's body limit and its 413
hold for forms too) and parsed in memory: no temporary files, no thread pool.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import msgspec
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from services.api.errors import ApiError
from shared.errors import ErrorKind

FORM_TYPE = "multipart/form-data"
FILE_FIELD = "file"
MAX_FORM_PARTS = 64  # far more than any route has fields; bounds the work on a hostile body
#: fields whose value is text as sent, never read as JSON
TEXT_FIELDS = frozenset({"prompt", "request_id", "stop", "language", "task", "model", "response_format", "user"})
#: fields that may be given several times (their values make a list)
LIST_FIELDS = frozenset({"stop"})

# python-multipart logs a warning for every malformed body; the client's 400 says it already.
logging.getLogger("python_multipart").setLevel(logging.ERROR)


class Form(NamedTuple):
    fields: dict[str, Any]  # typed as a JSON body would be (see the module docstring)
    file: bytes | None  # the `file` part's bytes; None when the form has no such part
    files: dict[str, list[bytes]]  # the parts of the route's `file_fields`, by name


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_form(content_type: str | None) -> bool:
    return media_type(content_type) == FORM_TYPE


class _Part:
    __slots__ = ("data", "disposition")

    def __init__(self) -> None:
        self.disposition = b""
        self.data = bytearray()


def _parts(body: bytes, boundary: bytes) -> list[tuple[str, bytes]]:
    """(name, raw bytes) of every part, in order; raises ApiError for a malformed body."""
    parts: list[tuple[str, bytes]] = []
    current = _Part()
    header_name = bytearray()
    header_value = bytearray()
    ended = False

    def on_part_begin() -> None:
        nonlocal current
        if len(parts) >= MAX_FORM_PARTS:
            raise ApiError(ErrorKind.INVALID, f"the form has more than {MAX_FORM_PARTS} parts")
        current = _Part()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        if bytes(header_name).lower() == b"content-disposition":
            current.disposition = bytes(header_value)
        header_name.clear()
        header_value.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        current.data.extend(data[start:end])

    def on_part_end() -> None:
        _, options = parse_options_header(current.disposition)
        raw_name = options.get(b"name")
        if not raw_name:
            raise ApiError(ErrorKind.INVALID, 'a form part has no name (Content-Disposition: form-data; name="...")')
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(ErrorKind.INVALID, "a form part's name is not valid UTF-8") from None
        parts.append((name, bytes(current.data)))

    def on_end() -> None:
        nonlocal ended
        ended = True

    callbacks = {
        "on_part_begin": on_part_begin, "on_part_data": on_part_data, "on_part_end": on_part_end,
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_end": on_end,
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        parser.write(body)
        parser.finalize()
    except FormParserError as exc:
        raise ApiError(ErrorKind.INVALID, f"the multipart/form-data body is malformed: {exc}") from None
    if not ended:
        raise ApiError(ErrorKind.INVALID, "the multipart/form-data body is incomplete (no closing boundary)")
    return parts


def typed_value(name: str, value: str) -> Any:
    """A form field's text as the JSON value it spells (see the module docstring)."""
    if value == "":
        return None
    if name in TEXT_FIELDS:
        return value
    try:
        return msgspec.json.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return value


def parse_form(body: bytes, content_type: str | None, file_fields: frozenset[str] = frozenset()) -> Form:
    """Read a multipart/form-data body; raises ApiError (400) for anything malformed.
    `file_fields`: the names of parts kept as bytes besides `file` (module docstring)."""
    if not is_form(content_type):
        got = media_type(content_type) or "none"
        name = min(file_fields) if file_fields else FILE_FIELD
        raise ApiError(ErrorKind.INVALID,
                       f"the body must be {FORM_TYPE} with a {name!r} part (Content-Type: {got})", name)
    _, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if not boundary:
        raise ApiError(ErrorKind.INVALID, f"the {FORM_TYPE} Content-Type has no boundary")
    file: bytes | None = None
    texts: dict[str, list[str]] = {}
    files: dict[str, list[bytes]] = {}
    for name, data in _parts(body, boundary):
        if name in file_fields:
            files.setdefault(name, []).append(data)
            continue
        if name == FILE_FIELD:
            if file is not None:
                raise ApiError(ErrorKind.INVALID, f"the form has more than one {FILE_FIELD!r} part; send one file",
                               FILE_FIELD)
            file = data
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(ErrorKind.INVALID, f"form field {name!r} is not valid UTF-8", name) from None
        texts.setdefault(name, []).append(text)
    fields: dict[str, Any] = {}
    for name, values in texts.items():
        if len(values) > 1 and name not in LIST_FIELDS:
            raise ApiError(ErrorKind.INVALID, f"form field {name!r} is given {len(values)} times; give it once", name)
        items = [typed_value(name, v) for v in values]
        if name in LIST_FIELDS and len(items) > 1:
            fields[name] = items
        else:
            fields[name] = items[0]
    return Form(fields, file, files)

