"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

An `ApiError` keeps its HTTP status (the one table in `services/api/errors.py` chooses it);
only the body changes. Anthropic's error object has no `param`, so a 400's message starts
with the field's path written Anthropic's way (`messages.1.content.0.tool_use_id: ...`).
The shared chat path and the conductor name chat fields (`prompt`, `messages[0]...`): they
are mapped back to this dialect's names here, so no refusal names a field the client never sent.
"""

from __future__ import annotations

import re

from starlette.responses import Response

from services.api.dialects.messages.schemas import MessagesError, MessagesErrorObject
from services.api.errors import ApiError, HttpKind, Kind
from services.api.events import encode
from shared.errors import ErrorKind

#: an error kind -> Anthropic's error `type` (the status stays the kind's)
TYPES: dict[Kind, str] = {
    ErrorKind.INVALID: "invalid_request_error",
    ErrorKind.TOO_LONG: "invalid_request_error",
    ErrorKind.CONFLICT: "invalid_request_error",
    ErrorKind.UNAVAILABLE: "overloaded_error",
    ErrorKind.WORKER_FAILED: "api_error",
    ErrorKind.INTERNAL: "api_error",
    HttpKind.UNAUTHORIZED: "authentication_error",
    HttpKind.NOT_FOUND: "not_found_error",
    HttpKind.MODEL_NOT_FOUND: "not_found_error",
    HttpKind.METHOD_NOT_ALLOWED: "invalid_request_error",
    HttpKind.TOO_LARGE: "request_too_large",
    HttpKind.RATE_LIMITED: "rate_limit_error",
}
#: fields of the chat path (and the engine) -> the Messages field they come from
CHAT_FIELDS = {"prompt": "messages", "input_ids": "messages", "max_completion_tokens": "max_tokens",
               "stop": "stop_sequences", "chat_template_kwargs": "thinking"}
_INDEX = re.compile(r"\[(\d+)\]")


def dotted(path: str) -> str:
    """`messages[1].content[0].text` as Anthropic writes it: `messages.1.content.0.text`."""
    return _INDEX.sub(r".\1", path)


def messages_param(param: str | None) -> str | None:
    """The Messages field a refusal's `param` stands for (chat names mapped back)."""
    if param is None:
        return None
    head, sep, rest = param.partition(".")
    return dotted(CHAT_FIELDS.get(head, head) + sep + rest)


def error_body(err: ApiError) -> MessagesError:
    """`err` as Anthropic's error object: its message names the field, and a server-side
    failure's error id (the key to the server's log) is kept in the message."""
    message = dotted(err.message)
    param = messages_param(err.param)
    if param and param not in message:
        message = f"{param}: {message}"
    if err.error_id:
        message = f"{message} (error id {err.error_id})"
    return MessagesError(MessagesErrorObject(TYPES.get(err.kind, "api_error"), message))


def error_response(err: ApiError) -> Response:
    """The refusal of a Messages request: `err`'s status, Anthropic's body."""
    return Response(encode(error_body(err)), status_code=err.status, media_type="application/json")


def error_event(err: ApiError) -> bytes:
    """A failure after the stream began: Anthropic's `event: error`."""
    return b"event: error\ndata: " + encode(error_body(err)) + b"\n\n"
