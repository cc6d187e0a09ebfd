"""The api's dialects past OpenAI's chat: each folder reads its own bodies, writes its own
replies, events and errors, and generates through the one chat path (`services/api/chat.py`).

- `messages/`: Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`);
- `responses/`: OpenAI's Responses API (`/v1/responses` and its stored responses).

Each dialect's package exports `ROUTES` (Starlette routes, mounted by `app.py`) and
`SHAPES` (its `(path, method) -> schemas.Route` entries for `/openapi.json`).
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from services.api.dialects import messages, responses
from services.api.schemas import Route

DIALECTS = (messages, responses)


def http_routes() -> list[BaseRoute]:
    return [route for dialect in DIALECTS for route in dialect.ROUTES]


def shapes() -> dict[tuple[str, str], Route]:
    return {key: shape for dialect in DIALECTS for key, shape in dialect.SHAPES.items()}
