"""OpenAI's Responses API (`/v1/responses`), on the one chat path (`services/api/chat.py`)."""

from __future__ import annotations

from starlette.routing import BaseRoute

from services.api.schemas import Route

#: the dialect's Starlette routes, mounted by `app.py`
ROUTES: list[BaseRoute] = []
#: its routes' declared shapes, published in `/openapi.json`
SHAPES: dict[tuple[str, str], Route] = {}
