"""The Responses API's routes: `POST /v1/responses` (through `serving.serve`, so it is
counted in /metrics and a client that goes away aborts it), and the stored responses'
`GET` / `DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.

Cancel: this server runs no background responses, so every response it knows is already
finished; OpenAI answers a cancel of a response that was not created with `background: true`
with a 400, and so does this one (404 for an id it does not know).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.routing import Route as HttpRoute

from services.api.chat import plan_chat
from services.api.chat_request import parse_chat
from services.api.dialects.responses.reply import ReplyContext, ResponsesReply, echo_fields, new_id
from services.api.dialects.responses.schemas import ResponseDeleted, ResponseObject, ResponsesRequest
from services.api.dialects.responses.store import ResponseStore
from services.api.dialects.responses.translate import (
    chat_body,
    input_items,
    parse_request,
    rename,
    renamed,
    to_messages,
)
from services.api.errors import ApiError, HttpKind, invalid
from services.api.schemas import Route
from services.api.serving import Prepared, api_state, error_response, json_response, serve
from services.api.state import ApiState
from services.api.streaming import EventStream
from services.api.validation import ImageRef


def not_found(response_id: str, param: str | None) -> ApiError:
    """OpenAI's 404 for a response id it does not have (never stored, evicted, expired, or
    lost when the api restarted: the store lives in its memory)."""
    err = ApiError(HttpKind.NOT_FOUND, f"Response with id '{response_id}' not found.", param,
                   code="previous_response_not_found" if param == "previous_response_id" else None)
    err.type = "invalid_request_error"  # OpenAI's type for it
    return err


def store_of(request: Request) -> ResponseStore:
    """The api process's one store, made at its first use from the settings."""
    store: ResponseStore | None = getattr(request.app.state, "responses_store", None)
    if store is None:
        settings = api_state(request).settings
        store = ResponseStore(settings.responses_store_max, settings.responses_store_ttl_s)
        request.app.state.responses_store = store
    return store


def accept(obj: dict[str, Any], state: ApiState, store: ResponseStore) -> Prepared:
    """A Responses body -> the chat request it asks for, and the reply that answers it."""
    req = parse_request(obj)
    before: tuple[Any, ...] = ()
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        before = found.items
    items = (*before, *input_items(req))
    messages, origins = to_messages(items, len(before), req.instructions)
    if not messages:
        raise invalid("input", "input must hold at least one item (or give instructions)")
    settings = state.settings
    chat, chat_messages = renamed(origins, parse_chat, chat_body(req, messages), settings.model_name,
                                  vision=bool(settings.image_placeholder))
    plan = renamed(origins, plan_chat, chat, chat_messages, state, "input")
    response_id = new_id("resp")
    refs = tuple(ImageRef(r.url, rename(r.param, origins)) for r in plan.req.params.image_refs)
    params = msgspec.structs.replace(plan.req.params, request_id=response_id, image_refs=refs)
    tokenizer = state.tokenizer
    ctx = ReplyContext(response_id, settings.model_name, int(time.time()), echo_fields(req), plan.tool_format,
                       plan.tools_forced, plan.reasoning, items, store if req.store is not False else None,
                       lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids))
    return Prepared(params, bool(req.stream), ResponsesReply(ctx))


async def create(request: Request) -> Response | EventStream:
    """POST /v1/responses."""
    store = store_of(request)
    return await serve(request, lambda obj, state: accept(obj, state, store), "/v1/responses")


async def retrieve(request: Request) -> Response:
    """GET /v1/responses/{response_id}: a stored response."""
    response_id = request.path_params["response_id"]
    found = store_of(request).get(response_id)
    if found is None:
        return error_response(not_found(response_id, None))
    return json_response(found.response)


async def delete(request: Request) -> Response:
    """DELETE /v1/responses/{response_id}: OpenAI's deleted object."""
    response_id = request.path_params["response_id"]
    if not store_of(request).delete(response_id):
        return error_response(not_found(response_id, None))
    return json_response(ResponseDeleted(response_id))


async def cancel(request: Request) -> Response:
    """POST /v1/responses/{response_id}/cancel: 400, as OpenAI answers for a response not
    created with `background: true` (none is, here)."""
    response_id = request.path_params["response_id"]
    if store_of(request).get(response_id) is None:
        return error_response(not_found(response_id, None))
    return error_response(invalid("response_id", f"Only responses created with background=true can be cancelled; "
                                                 f"response '{response_id}' is already complete."))


ROUTES: list[BaseRoute] = [
    HttpRoute("/v1/responses", create, methods=["POST"]),
    HttpRoute("/v1/responses/{response_id}", retrieve, methods=["GET"]),
    HttpRoute("/v1/responses/{response_id}", delete, methods=["DELETE"]),
    HttpRoute("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
]

SHAPES: dict[tuple[str, str], Route] = {
    ("/v1/responses", "post"): Route(ResponsesRequest, ResponseObject),
    ("/v1/responses/{response_id}", "get"): Route(response=ResponseObject),
    ("/v1/responses/{response_id}", "delete"): Route(response=ResponseDeleted),
    ("/v1/responses/{response_id}/cancel", "post"): Route(),
}
