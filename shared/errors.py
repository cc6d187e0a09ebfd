"""What can go wrong with a request, as every service names it.

A failure travels between services as an `ErrorKind` (on `RequestError` frames), never as
an HTTP status: only the api decides how a kind is shown to a client (services/api/errors.py
maps kinds to statuses and OpenAI error types). So the engine, the conductor and the data
worker say what happened, not how HTTP spells it.

Every failure a client cannot fix (`INTERNAL`, `WORKER_FAILED`) gets an error id from
`new_error_id()`, logged with the details where it happened; the client sees the id only.
"""

from __future__ import annotations

import enum
import uuid


class ErrorKind(enum.StrEnum):
    #: the request is malformed or names a value out of range (the message names the field)
    INVALID = "invalid"
    #: prompt and output cannot fit the model's or the pool's limits
    TOO_LONG = "too_long"
    #: the request collides with one already running (a duplicate request id)
    CONFLICT = "conflict"
    #: a service the request needs is gone or stopping; retrying later may work
    UNAVAILABLE = "unavailable"
    #: the worker running the request died; the request was not completed
    WORKER_FAILED = "worker_failed"
    #: a bug (model, layout, engine): details are in the log under the error id
    INTERNAL = "internal"


#: kinds whose details stay in the log: the client gets an error id
SERVER_SIDE = frozenset({ErrorKind.INTERNAL, ErrorKind.WORKER_FAILED, ErrorKind.UNAVAILABLE})


def new_error_id() -> str:
    """A fresh id that ties what a client sees to the log line holding the details."""
    return f"err-{uuid.uuid4().hex}"
