"""OpenAI's Chat Completions and Completions APIs (`/v1/chat/completions`,
`/v1/completions`) and its model list (`/v1/models`), chat on the one chat path
(`services/api/chat.py`).

- `params.py`: a `/v1/completions` body -> `TextCompletionRequest` (a chat body is read by
  the core, `chat_request.parse_chat`, which `/v1/responses` shares);
- `reply.py`: `text_completion` / `chat.completion` objects and their SSE chunks, logprobs
  objects, several choices (`ManyReply`);
- `routes.py`: the routes, `ROUTES` and `SHAPES`.

OpenAI's task routes (`/v1/embeddings`, `/v1/audio/transcriptions`, `/v1/audio/speech`)
are a module each in the api's root: they share no body, reply or chat path with these.
"""

from __future__ import annotations

from services.api.dialects.openai.routes import ROUTES, SHAPES

__all__ = ["ROUTES", "SHAPES"]
