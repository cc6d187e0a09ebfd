"""OpenAI's Responses API (`/v1/responses`), on the one chat path (`services/api/chat.py`).

- `schemas.py`: the request, its input items, the response object, its items and events;
- `translate.py`: a body's items and settings -> chat messages and a chat request;
- `reply.py`: the response object (JSON) and OpenAI's typed SSE events;
- `store.py`: stored responses (an LRU with a TTL, in the api's memory);
- `routes.py`: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `.../cancel`.
"""

from __future__ import annotations

from services.api.dialects.responses.routes import ROUTES, SHAPES

__all__ = ["ROUTES", "SHAPES"]
