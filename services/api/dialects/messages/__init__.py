"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), on the one chat
path (`services/api/chat.py`).

- `schemas.py`: the bodies, replies and stream events (msgspec Structs);
- `translate.py`: a body -> the chat request and plain-dict messages (refusals name Messages fields);
- `reply.py`: the `message` object and Anthropic's event stream;
- `errors.py`: `{"type": "error", "error": {"type", "message"}}` for every refusal;
- `routes.py`: the two routes.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from services.api.dialects.messages.routes import count_tokens, messages
from services.api.dialects.messages.schemas import (
    MessagesCountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    MessagesTokenCount,
)
from services.api.schemas import Route as Shape

#: the dialect's Starlette routes, mounted by `app.py`
ROUTES: list[BaseRoute] = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
#: its routes' declared shapes, published in `/openapi.json`
SHAPES: dict[tuple[str, str], Shape] = {
    ("/v1/messages", "post"): Shape(MessagesRequest, MessagesResponse),
    ("/v1/messages/count_tokens", "post"): Shape(MessagesCountTokensRequest, MessagesTokenCount),
}
