"""Client-facing errors: one exception type and one body shape for every route.

Every failure a client sees, from a validation 400 to a conductor's length refusal to a
server bug, becomes an `ApiError` and then OpenAI's error object
`{"error": {"message", "type", "param", "error_id"}}` (DESIGN.md section 7), so clients
and the OpenAI routes handle one shape. A few errors also carry OpenAI's `code`
(`model_not_found`, `invalid_api_key`); the key is present only when there is one. Server-side failures (status >= 500) carry an
`error_id` under which the details were logged; the body never carries internals.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from shared.frames import RequestError

log = logging.getLogger("mstar.api")

# The `type` field for each status we produce; OpenAI-style names where OpenAI has one.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's type for a bad key (with code invalid_api_key)
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def new_error_id() -> str:
    """A fresh id that ties a 5xx body to the log line holding its details."""
    return f"err-{uuid.uuid4().hex}"


def error_type_for(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "internal_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """A failure to report to the client as `status` plus the error body.

    `message` must be safe to show (it names the field and the limit, never internals);
    `param` names the offending request field, or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        error_id: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or error_type_for(status)
        self.error_id = error_id
        self.code = code

    def error_object(self) -> dict[str, Any]:
        """The inner `error` object (also used inside SSE / WebSocket error events)."""
        obj: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "error_id": self.error_id}
        if self.code is not None:
            obj["code"] = self.code
        return obj

    def body(self) -> dict[str, Any]:
        return {"error": self.error_object()}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r})"


def internal_error(context: str, exc: BaseException | None = None) -> ApiError:
    """Log a server bug with its traceback under a new error id; return the client-safe 500."""
    error_id = new_error_id()
    log.error("internal error %s while %s", error_id, context, exc_info=exc)
    return ApiError(500, "internal error", None, "internal_error", error_id)


def from_request_error(err: RequestError) -> ApiError:
    """Turn a peer's `RequestError` frame into the client error, keeping its status.

    The peer's message is client-safe by contract and passes through. A 5xx without an
    error id (a peer bug) gets one here so the client can still quote something.
    """
    error_id = err.error_id
    if err.status >= 500 and not error_id:
        error_id = new_error_id()
        log.error("request %s failed with %d and no error id from its peer: %s (logged as %s)",
                  err.request_id, err.status, err.message, error_id)
    status = err.status if 400 <= err.status <= 599 else 500
    err_type = err.error_type or None
    if status >= 500 and err_type == "invalid_request_error":  # the frame's default, not a choice
        err_type = None
    return ApiError(status, err.message, err.param, err_type, error_id)
