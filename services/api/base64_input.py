"""A media file carried as base64 in a JSON field: bounded before decoding (from the base64
length, so an oversized upload costs no decode) and decoded strictly, each refusal a 400
naming the field. The audio and video inputs share it; each checks its own container after."""

from __future__ import annotations

import base64
import binascii

from services.api.errors import invalid


def decode_capped(data: str, limit: int, param: str, what: str) -> bytes:
    """`data`'s bytes (base64; white space ignored), or a 400 on `param` when it is longer
    than `limit` bytes of `what` could encode or is not valid base64."""
    if len(data) > 4 * (limit // 3 + 2):
        raise invalid(param, f"the {what} has more bytes than allowed; the limit is {limit} bytes")
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(param, f"{param} is not valid base64") from exc
