"""Errors are named by kind everywhere; only the api's table turns a kind into an HTTP
status and an OpenAI error type, and every server-side failure carries one error id."""

from __future__ import annotations

import re

import msgspec
import pytest

from services.api.errors import HTTP_ERRORS, ApiError, HttpKind, from_request_error, kind_for_status
from shared.errors import SERVER_SIDE, ErrorKind, new_error_id
from shared.frames import FrameCodec, RequestError, ToApi

#: what clients have always seen for each kind (the tests of the routes assert these bodies)
EXPECTED = {
    ErrorKind.INVALID: (400, "invalid_request_error"),
    ErrorKind.TOO_LONG: (400, "invalid_request_error"),
    ErrorKind.CONFLICT: (409, "conflict_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.WORKER_FAILED: (503, "worker_failed"),
    ErrorKind.INTERNAL: (500, "internal_error"),
    HttpKind.UNAUTHORIZED: (401, "invalid_request_error"),
    HttpKind.NOT_FOUND: (404, "not_found_error"),
    HttpKind.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    HttpKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
    HttpKind.TOO_LARGE: (413, "request_too_large"),
    HttpKind.RATE_LIMITED: (429, "rate_limit_error"),
}


def test_every_kind_has_its_status_and_type():
    assert set(HTTP_ERRORS) == set(ErrorKind) | set(HttpKind) == set(EXPECTED)
    for kind, (status, type_) in EXPECTED.items():
        err = ApiError(kind, "m")
        assert (err.status, err.type) == HTTP_ERRORS[kind] == (status, type_), kind


def test_server_side_kinds_are_the_5xx_ones():
    assert {k for k in ErrorKind if HTTP_ERRORS[k][0] >= 500} == SERVER_SIDE


@pytest.mark.parametrize("status", [404, 405, 500, 503, 400, 418])
def test_a_framework_status_keeps_its_status(status):
    kind = kind_for_status(status)
    assert HTTP_ERRORS[kind][0] == (status if status != 418 else 400)


def test_error_ids_are_one_shape():
    ids = {new_error_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"err-[0-9a-f]{32}", i) for i in ids)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_a_request_error_frame_round_trips_and_becomes_its_client_error(kind):
    codec = FrameCodec(ToApi)
    frame = RequestError("r1", kind, "what happened", "max_tokens", None, "some_code")
    got, _ = codec.decode(codec.encode(frame))
    assert got == frame and got.kind is kind
    err = from_request_error(got)
    assert (err.status, err.type) == EXPECTED[kind]
    body = err.body()["error"]
    assert body["message"] == "what happened" and body["param"] == "max_tokens" and body["code"] == "some_code"
    # A server-side failure always carries an error id, one its peer sent or a new one.
    assert (body["error_id"] is not None) == (kind in SERVER_SIDE)
    sent = from_request_error(RequestError("r1", kind, "m", error_id="err-" + "0" * 32))
    assert sent.error_id == "err-" + "0" * 32


def test_a_frame_with_a_status_instead_of_a_kind_is_refused():
    codec = FrameCodec(ToApi)
    wire = msgspec.msgpack.encode(["request_error", "r1", 503, "m"])
    with pytest.raises(msgspec.ValidationError):
        codec.decode([wire])
