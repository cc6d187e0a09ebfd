"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, and
`/openapi.json` (generated from the bodies declared in `schemas.py`, as vLLM and SGLang
publish theirs).

They run on the same machinery as `/generate` (`serving.serve`: body limit, submission,
disconnect aborts, SSE) and differ only in how a body is read (`openai_params.py`) and
how the answer is shaped (`openai_format.py`). Chat prompts are the checkpoint's chat
template rendered here (`chat_template.py`) and sent with `add_special_tokens=False`.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api.chat import plan_chat
from services.api.chat_request import check_model, parse_chat, parse_completion
from services.api.dialects import shapes
from services.api.fanout import Choice, expand
from services.api.openai_format import ChatReply, CompletionReply, ManyReply
from services.api.openapi import openapi
from services.api.schemas import ModelCard, ModelList
from services.api.serving import Prepared, api_state, json_response, serve
from services.api.state import ApiState
from services.api.streaming import EventStream
from services.api.validation import GenerateParams
from shared.version import mstar_version


def _model_card(state: ApiState) -> ModelCard:
    """OpenAI's model object plus vLLM's `max_model_len` (the deployment's max_seq_len)."""
    settings = state.settings
    inputs = ["audio"] if settings.takes_audio else ["text"]
    if settings.image_placeholder:
        inputs.append("image")
    outputs = {"generate": ["text"], "embed": ["embedding"], "speech": ["audio"]}.get(settings.task, ["score"])
    defaults = msgspec.structs.asdict(settings.generation_defaults)
    return ModelCard(settings.model_name, state.created, settings.max_model_len, inputs, outputs,
                     image_placeholder=settings.image_placeholder or None,
                     default_sampling={k: v for k, v in defaults.items() if v is not None} or None)


async def list_models(request: Request) -> Response:
    """GET /v1/models: the one served model."""
    return json_response(ModelList([_model_card(api_state(request))]))


async def get_model(request: Request) -> Response:
    """GET /v1/models/{model}: the served model, or 404 model_not_found."""
    state = api_state(request)
    check_model(request.path_params["model"], state.settings.model_name)
    return json_response(_model_card(state))


@functools.cache
def _openapi_document() -> bytes:
    return msgspec.json.encode(openapi(mstar_version(), shapes()))


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the OpenAPI 3.1 document of the routes' declared shapes (`schemas.py`)."""
    return Response(_openapi_document(), media_type="application/json")


def _accept_completion(obj: dict[str, Any], state: ApiState) -> Prepared:
    req = parse_completion(obj, state.settings.model_name)
    params = req.params
    created = int(time.time())

    def reply(p: GenerateParams, index: int = 0, final_usage: bool = True) -> CompletionReply:
        echo = ""
        if req.echo:
            echo = (p.prompt if p.prompt is not None
                    else state.tokenizer.decode(p.input_ids or [], skip_special_tokens=False))
        return CompletionReply(params.request_id, state.settings.model_name, created,
                               include_usage=req.include_usage, echo=echo, tokenizer=state.tokenizer,
                               logprobs=req.logprobs, index=index, final_usage=final_usage)

    choices = expand(params, req.prompts, req.n)
    if not choices:
        return Prepared(params, req.stream, reply(params))
    many = ManyReply([reply(c.params, i, False) for i, c in enumerate(choices)], _firsts(choices))
    return Prepared(params, req.stream, many, choices)


def _firsts(choices: list[Choice]) -> set[int]:
    return {i for i, c in enumerate(choices) if c.after is None}


def _accept_chat(obj: dict[str, Any], state: ApiState) -> Prepared:
    req, messages = parse_chat(obj, state.settings.model_name, vision=bool(state.settings.image_placeholder))
    plan = plan_chat(req, messages, state)
    req = plan.req
    created = int(time.time())

    def reply(index: int = 0, final_usage: bool = True) -> ChatReply:
        return ChatReply(req.params.request_id, state.settings.model_name, created, include_usage=req.include_usage,
                         tokenizer=state.tokenizer, logprobs=req.logprobs, index=index, final_usage=final_usage,
                         tool_format=plan.tool_format, tools_forced=plan.tools_forced, reasoning=plan.reasoning)

    choices = expand(req.params, [], req.n)
    if not choices:
        return Prepared(req.params, req.stream, reply())
    return Prepared(req.params, req.stream, ManyReply([reply(i, False) for i in range(len(choices))],
                                                      _firsts(choices)), choices)


async def completions(request: Request) -> Response | EventStream:
    """POST /v1/completions."""
    return await serve(request, _accept_completion, "/v1/completions")


async def chat_completions(request: Request) -> Response | EventStream:
    """POST /v1/chat/completions."""
    return await serve(request, _accept_chat, "/v1/chat/completions")
