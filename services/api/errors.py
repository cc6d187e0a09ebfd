"""Client-facing errors: one exception type and one body shape for every route.

Every failure a client sees, from a validation 400 to a conductor's length refusal to a
server bug, becomes an `ApiError` and then OpenAI's error object
`{"error": {"message", "type", "param", "error_id"}}` (DESIGN.md section 7), so clients
and the OpenAI routes handle one shape. A few errors also carry OpenAI's `code`
(`model_not_found`, `invalid_api_key`); the key is always there, null when there is none.

An error is named by its kind: a shared `ErrorKind` (what every service says went wrong,
carried on `RequestError` frames) or an `HttpKind` (what only HTTP itself meets). This
module alone turns a kind into an HTTP status and an OpenAI `type` (`HTTP_ERRORS`).
Server-side failures (`SERVER_SIDE` kinds) carry an `error_id` under which the details
were logged; the body never carries internals.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from shared.errors import SERVER_SIDE, ErrorKind, new_error_id
from shared.frames import RequestError

log = logging.getLogger("mstar.api")


class HttpKind(enum.StrEnum):
    """Failures only the api meets (HTTP concerns); no other service names them."""

    #: no API key, or the wrong one
    UNAUTHORIZED = "unauthorized"
    #: no such route, or no such live request on a socket
    NOT_FOUND = "not_found"
    #: the request names a model this server does not serve
    MODEL_NOT_FOUND = "model_not_found"
    #: the route exists but not for this method
    METHOD_NOT_ALLOWED = "method_not_allowed"
    #: a body or WebSocket frame over the size limit
    TOO_LARGE = "too_large"
    #: too many live requests on one WebSocket
    RATE_LIMITED = "rate_limited"


Kind = ErrorKind | HttpKind

#: How a client sees each kind: (HTTP status, the error object's `type`), OpenAI-style
#: names where OpenAI has one. The only place a status or a type is chosen.
HTTP_ERRORS: dict[Kind, tuple[int, str]] = {
    ErrorKind.INVALID: (400, "invalid_request_error"),
    ErrorKind.TOO_LONG: (400, "invalid_request_error"),
    ErrorKind.CONFLICT: (409, "conflict_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.WORKER_FAILED: (503, "worker_failed"),
    ErrorKind.INTERNAL: (500, "internal_error"),
    HttpKind.UNAUTHORIZED: (401, "invalid_request_error"),  # OpenAI's, with code invalid_api_key
    HttpKind.NOT_FOUND: (404, "not_found_error"),
    HttpKind.MODEL_NOT_FOUND: (404, "invalid_request_error"),  # OpenAI's, with code model_not_found
    HttpKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    HttpKind.TOO_LARGE: (413, "request_too_large"),
    HttpKind.RATE_LIMITED: (429, "rate_limit_error"),
}


def kind_for_status(status: int) -> Kind:
    """The kind shown with `status` (for statuses a framework chose, e.g. Starlette's 404
    and 405): the first kind in `HTTP_ERRORS` with it, else invalid / internal."""
    for kind, (s, _) in HTTP_ERRORS.items():
        if s == status:
            return kind
    return ErrorKind.INTERNAL if status >= 500 else ErrorKind.INVALID


class ApiError(Exception):
    """A failure of `kind` to report to the client as its status plus the error body.

    `message` must be safe to show (it names the field and the limit, never internals);
    `param` names the offending request field, or None.
    """

    def __init__(
        self,
        kind: Kind,
        message: str,
        param: str | None = None,
        error_id: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status, self.type = HTTP_ERRORS[kind]
        self.message = message
        self.param = param
        self.error_id = error_id
        self.code = code

    def error_object(self) -> dict[str, Any]:
        """The inner `error` object (also used inside SSE / WebSocket error events)."""
        return {"message": self.message, "type": self.type, "param": self.param, "error_id": self.error_id,
                "code": self.code}

    def body(self) -> dict[str, Any]:
        return {"error": self.error_object()}

    def __repr__(self) -> str:
        return f"ApiError({self.kind.value}, {self.status}, {self.message!r}, param={self.param!r})"


def invalid(param: str, message: str) -> ApiError:
    """A 400 for the client's request: `message` names the field `param` and the rule."""
    return ApiError(ErrorKind.INVALID, message, param)


def internal_error(context: str, exc: BaseException | None = None) -> ApiError:
    """Log a server bug with its traceback under a new error id; return the client-safe 500."""
    error_id = new_error_id()
    log.error("internal error %s while %s", error_id, context, exc_info=exc)
    return ApiError(ErrorKind.INTERNAL, "internal error", None, error_id)


def from_request_error(err: RequestError) -> ApiError:
    """Turn a peer's `RequestError` frame into the client error for its kind.

    The peer's message is client-safe by contract and passes through. A server-side kind
    without an error id (a peer bug) gets one here so the client can still quote something.
    """
    error_id = err.error_id
    if err.kind in SERVER_SIDE and not error_id:
        error_id = new_error_id()
        log.error("request %s failed (%s) with no error id from its peer: %s (logged as %s)",
                  err.request_id, err.kind.value, err.message, error_id)
    return ApiError(err.kind, err.message, err.param, error_id, err.code)
