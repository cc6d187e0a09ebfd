"""The Starlette app: routes only; validation, streaming and ZMQ live in their modules.

Routes: `POST /generate` (JSON or SSE; a multipart/form-data body carries an audio file
for a speech model), `/generate/ws` (WebSocket), each dialect's (`dialects.http_routes()`:
OpenAI's `GET /v1/models[/{model}]`, `POST /v1/completions`, `POST /v1/chat/completions`;
`/v1/responses`; Anthropic's `/v1/messages`), the task routes (`POST /v1/embeddings`,
`/v1/score`, `/v1/rerank`, `/v1/audio/transcriptions`, `/v1/audio/speech`), vLLM's
`POST /tokenize`, `POST /detokenize`, `GET /version`, and `GET /openapi.json`,
`GET /health` (and `/healthz`, openpi's), `GET /ready`, `GET /metrics`; for a robot policy
also openpi's WebSocket policy protocol at `/` and `/openpi` (`openpi.py`). Build it with
`create_app(settings, tokenizer)`; the backend binds its socket in the lifespan (or at the
first request if the lifespan did not run), and nothing else needs to be up for the app to start and answer 400s. The
lifespan also runs the periodic stats line (`stats_log.py`). With `settings.api_key` set,
`ApiKeyMiddleware` wraps everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from tokenizers import Tokenizer

from services.api import actions, dialects, embeddings, openpi, scoring, speech, tokenization, transcription, world
from services.api.auth import ApiKeyMiddleware
from services.api.chat_template import ChatTemplate
from services.api.errors import ApiError, internal_error, kind_for_status
from services.api.forms import Form, is_form, parse_form
from services.api.metrics import CONTENT_TYPE
from services.api.openapi import openapi
from services.api.serving import Prepared, api_state, error_response, guard, json_response, serve
from services.api.settings import ApiSettings
from services.api.state import ApiState
from services.api.stats_log import StatsLogger
from services.api.streaming import EventStream, GenerateReply
from services.api.validation import parse_audio_generate, parse_generate
from services.api.ws import WsSession
from shared.model_source import TokenizerBundle
from shared.version import mstar_version

log = logging.getLogger("mstar.api")

_state = api_state


def _accept_generate(obj: dict[str, Any], state: ApiState) -> Prepared:
    params = parse_generate(obj)
    return Prepared(params, bool(params.stream), GenerateReply(params.request_id))


def _accept_generate_form(form: Form, state: ApiState) -> Prepared:
    transcription.require_speech_model(state.settings.takes_audio)
    params = parse_audio_generate(form.fields, form.file)
    return Prepared(params, bool(params.stream), GenerateReply(params.request_id))


async def generate(request: Request) -> Response | EventStream:
    """POST /generate: validate, submit, then one JSON reply or an SSE stream. A
    multipart/form-data body is an audio request (`file` + the other fields as form fields)."""
    if is_form(request.headers.get("content-type")):
        return await serve(request, _accept_generate_form, "/generate", decode=parse_form)
    return await serve(request, _accept_generate, "/generate")


async def generate_ws(ws: WebSocket) -> None:
    await WsSession(ws, _state(ws)).run()


async def health(request: Request) -> Response:
    """200 while the process lives (liveness, not readiness)."""
    return json_response({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 only when the conductor answers and reports at least one ready worker."""
    state = _state(request)
    status = await state.backend.cluster_status()
    state.metrics.set_cluster_status(status)
    if status is None:
        timeout = state.settings.status_timeout_s
        return json_response({"status": "not_ready", "reason": f"conductor did not answer within {timeout:g} s"}, 503)
    if status.ready_workers < 1:
        return json_response({"status": "not_ready", "reason": "no worker is ready yet", "ready_workers": 0}, 503)
    return json_response({"status": "ready", "ready_workers": status.ready_workers})


async def metrics(request: Request) -> Response:
    state = _state(request)
    state.metrics.set_cluster_status(await state.backend.cluster_status())
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@functools.cache
def _openapi_document() -> bytes:
    return msgspec.json.encode(openapi(mstar_version(), dialects.shapes()))


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the OpenAPI 3.1 document of the routes' declared shapes
    (`openapi.ROUTES` and every dialect's `SHAPES`); served here, where the dialects are
    assembled, so no dialect imports the others' shapes."""
    return Response(_openapi_document(), media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 in the usual error shape (clients parse one shape)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    err = ApiError(kind_for_status(exc.status_code), message)
    return json_response(err.body(), err.status, exc.headers)


async def _unhandled(request: Request, exc: Exception) -> Response:
    return error_response(internal_error(f"serving {request.url.path}", exc))


def create_app(settings: ApiSettings, tokenizer: Tokenizer | TokenizerBundle,
               state: ApiState | None = None) -> Starlette:
    """The api as an ASGI app; run it with uvicorn (see `services.api.__main__`).

    Given a `TokenizerBundle`, its chat template (with its BOS / EOS strings) serves
    `/v1/chat/completions`; given a bare `Tokenizer`, chat is a 400 (no template).
    """
    if isinstance(tokenizer, TokenizerBundle):
        template = None
        if tokenizer.chat_template:
            template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
        api = state or ApiState(settings, tokenizer.tokenizer, chat_template=template,
                                eos_token_ids=tokenizer.eos_token_ids)
    else:
        api = state or ApiState(settings, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await api.backend.start()
        log.info("api serving %s", settings.model_name)
        stats = None
        if api.settings.log_stats_s > 0:
            stats = asyncio.get_running_loop().create_task(
                StatsLogger(api.metrics, api.backend, api.settings.log_stats_s).run(), name="api-stats")
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats
            await api.backend.close()

    routes = [
        Route("/generate", generate, methods=["POST"]),
        WebSocketRoute("/generate/ws", generate_ws),
        # openpi's policy-server protocol: its client connects to ws://host:port (path /)
        *(WebSocketRoute(path, openpi.openpi_ws) for path in ("/", "/openpi")),
        Route("/openapi.json", guard(openapi_json), methods=["GET"]),
        Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
        Route("/v1/actions", actions.actions, methods=["POST"]),
        Route("/v1/world/rollout", world.rollout, methods=["POST"]),
        *(Route(path, scoring.score, methods=["POST"]) for path in ("/v1/score", "/score")),
        *(Route(path, scoring.rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
        *dialects.http_routes(),
        Route("/v1/audio/transcriptions", transcription.transcriptions, methods=["POST"]),
        Route("/v1/audio/speech", speech.speech, methods=["POST"]),
        Route("/tokenize", guard(tokenization.tokenize), methods=["POST"]),
        Route("/detokenize", guard(tokenization.detokenize), methods=["POST"]),
        Route("/version", guard(tokenization.version), methods=["GET"]),
        *(Route(path, guard(health), methods=["GET"]) for path in ("/health", "/healthz")),  # /healthz: openpi's
        Route("/ready", guard(ready), methods=["GET"]),
        Route("/metrics", guard(metrics), methods=["GET"]),
    ]
    middleware = [Middleware(ApiKeyMiddleware, api_key=settings.api_key)] if settings.api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _unhandled})
    app.state.api = api
    return app
