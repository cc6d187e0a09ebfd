"""OpenAI's routes: `GET /v1/models[/{model}]`, `POST /v1/completions`,
`POST /v1/chat/completions`, and their declared shapes (`ROUTES`, `SHAPES`).

They run on the same machinery as `/generate` (`serving.serve`: body limit, submission,
disconnect aborts, SSE) and differ only in how a body is read (`params.py` for
completions, the core's `chat_request.parse_chat` for chat) and how the answer is shaped
(`reply.py`). Chat prompts are the checkpoint's chat template rendered by the one chat
path (`chat.plan_chat`) and sent with `add_special_tokens=False`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from services.api.chat import plan_chat
from services.api.chat_request import check_model, parse_chat
from services.api.dialects.openai import image_edits, images, videos
from services.api.dialects.openai.chat_audio import speech_out
from services.api.dialects.openai.params import parse_completion
from services.api.dialects.openai.reply import ChatCompletion, ChatReply, Completion, CompletionReply, ManyReply
from services.api.fanout import Choice, expand
from services.api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from services.api.schemas import Route as Shape
from services.api.serving import Prepared, api_state, guard, json_response, serve
from services.api.state import ApiState
from services.api.streaming import EventStream
from services.api.validation import GenerateParams


def _model_card(state: ApiState) -> ModelCard:
    """OpenAI's model object plus vLLM's `max_model_len` (the deployment's max_seq_len)."""
    settings = state.settings
    inputs = ["audio"] if settings.takes_audio else ["text"]
    if settings.task == "rollout":  # a world model: a clip, actions, states; no text
        inputs = ["image", "actions", "state"]
    if settings.image_placeholder or settings.task == "act":
        inputs.append("image")
    if settings.task == "act":
        inputs.append("state")
    if settings.audio_placeholder:
        inputs.append("audio")
    if settings.video_placeholder:
        inputs.append("video")
    outputs = {"generate": ["text"], "embed": ["embedding"], "speech": ["audio"],
               "act": ["actions"], "rollout": ["embedding"], "image": ["image", "video"]}.get(settings.task, ["score"])
    if settings.voices and settings.task == "generate":  # an omni model's talker: speech out on chat
        outputs = ["text", "audio"]
    defaults = msgspec.structs.asdict(settings.generation_defaults)
    return ModelCard(settings.model_name, state.created, settings.max_model_len, inputs, outputs,
                     image_placeholder=settings.image_placeholder or None,
                     audio_placeholder=settings.audio_placeholder or None,
                     video_placeholder=settings.video_placeholder or None,
                     default_sampling={k: v for k, v in defaults.items() if v is not None} or None,
                     parameters=settings.parameters or None, active_parameters=settings.active_parameters or None,
                     task=settings.task)


async def list_models(request: Request) -> Response:
    """GET /v1/models: the one served model."""
    return json_response(ModelList([_model_card(api_state(request))]))


async def get_model(request: Request) -> Response:
    """GET /v1/models/{model}: the served model, or 404 model_not_found."""
    state = api_state(request)
    check_model(request.path_params["model"], state.settings.model_name)
    return json_response(_model_card(state))


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
    settings = state.settings
    speech = None
    if settings.audio_placeholder:  # an omni model: speech out where it has a talker
        obj = dict(obj)
        speech = speech_out(obj, settings.voices, settings.sample_rate, settings.model_name)
    req, messages = parse_chat(obj, settings.model_name, vision=bool(settings.image_placeholder),
                               audio=bool(settings.audio_placeholder), video=bool(settings.video_placeholder))
    if speech is not None:  # the worker ends the thinker at a stop string: the talker speaks up to it
        sampling = msgspec.structs.replace(req.params.sampling, stop=list(req.params.stop))
        req = msgspec.structs.replace(req, params=msgspec.structs.replace(
            req.params, options={**req.params.options, "voice": speech.voice,
                                 **speech.options(req.params.sampling.greedy)}, sampling=sampling))
    plan = plan_chat(req, messages, state)
    req = plan.req
    created = int(time.time())

    def reply(index: int = 0, final_usage: bool = True) -> ChatReply:
        return ChatReply(req.params.request_id, state.settings.model_name, created, include_usage=req.include_usage,
                         tokenizer=state.tokenizer, logprobs=req.logprobs, index=index, final_usage=final_usage,
                         tool_format=plan.tool_format, tools_forced=plan.tools_forced, reasoning=plan.reasoning,
                         speech=speech)

    choices = expand(req.params, [], req.n)
    if not choices:
        return Prepared(req.params, req.stream, reply())
    return Prepared(req.params, req.stream, ManyReply([reply(i, False) for i in range(len(choices))],
                                                      _firsts(choices)), choices)


async def image_generations(request: Request) -> Response | EventStream:
    """POST /v1/images/generations."""
    return await serve(request, images.accept, "/v1/images/generations")


async def image_edits_route(request: Request) -> Response | EventStream:
    """POST /v1/images/edits (a form: `image_edits.decode`)."""
    return await serve(request, image_edits.accept, image_edits.ROUTE, decode=image_edits.decode)


async def completions(request: Request) -> Response | EventStream:
    """POST /v1/completions."""
    return await serve(request, _accept_completion, "/v1/completions")


async def chat_completions(request: Request) -> Response | EventStream:
    """POST /v1/chat/completions."""
    return await serve(request, _accept_chat, "/v1/chat/completions")


#: the dialect's Starlette routes, mounted by `app.py` (`/v1/models` answers no generation,
#: so it is guarded rather than served)
ROUTES: list[BaseRoute] = [
    Route("/v1/models", guard(list_models), methods=["GET"]),
    Route("/v1/models/{model:path}", guard(get_model), methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/images/generations", image_generations, methods=["POST"]),
    Route(image_edits.ROUTE, image_edits_route, methods=["POST"]),
    Route("/v1/videos", guard(videos.create), methods=["POST"]),
    Route("/v1/videos/{video_id}", guard(videos.retrieve), methods=["GET"]),
    Route("/v1/videos/{video_id}", guard(videos.delete), methods=["DELETE"]),
    Route("/v1/videos/{video_id}/content", guard(videos.content), methods=["GET"]),
]
#: its routes' declared shapes, published in `/openapi.json`
SHAPES: dict[tuple[str, str], Shape] = {
    ("/v1/completions", "post"): Shape(CompletionRequest, Completion),
    ("/v1/chat/completions", "post"): Shape(ChatCompletionRequest, ChatCompletion),
    ("/v1/images/generations", "post"): Shape(images.ImageGenerationRequest, images.ImagesResponse),
    (image_edits.ROUTE, "post"): Shape(response=images.ImagesResponse, form=image_edits.ImageEditRequest),
    ("/v1/videos", "post"): Shape(videos.VideoCreateRequest, videos.VideoJob),
    ("/v1/videos/{video_id}", "get"): Shape(response=videos.VideoJob),
    ("/v1/models", "get"): Shape(response=ModelList),
    ("/v1/models/{model}", "get"): Shape(response=ModelCard),
}
