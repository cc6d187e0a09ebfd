"""The api's dialects: each folder reads its own bodies, writes its own replies, events and
errors, and generates through the one chat path (`services/api/chat.py`, its request in
`chat_request.py`). A dialect imports the core, never another dialect.

- `openai/`: OpenAI's Chat Completions and Completions (`/v1/chat/completions`,
  `/v1/completions`) and `/v1/models`;
- `messages/`: Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`);
- `responses/`: OpenAI's Responses API (`/v1/responses` and its stored responses).

Each dialect's package exports `ROUTES` (Starlette routes, mounted by `app.py`) and
`SHAPES` (its `(path, method) -> schemas.Route` entries for `/openapi.json`).
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from services.api.dialects import messages, openai, responses
from services.api.schemas import Route

DIALECTS = (openai, messages, responses)


def http_routes() -> list[BaseRoute]:
    return [route for dialect in DIALECTS for route in dialect.ROUTES]


def shapes() -> dict[tuple[str, str], Route]:
    return {key: shape for dialect in DIALECTS for key, shape in dialect.SHAPES.items()}
