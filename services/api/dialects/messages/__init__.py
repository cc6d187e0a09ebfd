"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), on the one chat
path (`services/api/chat.py`)."""

from __future__ import annotations

from starlette.routing import BaseRoute

from services.api.schemas import Route

#: the dialect's Starlette routes, mounted by `app.py`
ROUTES: list[BaseRoute] = []
#: its routes' declared shapes, published in `/openapi.json`
SHAPES: dict[tuple[str, str], Route] = {}
