"""`POST /v1/messages` and `POST /v1/messages/count_tokens`.

`/v1/messages` runs on `serving.serve` like `/v1/chat/completions` (body limit, submission,
/metrics, disconnect aborts, a stream whose status line waits for the first event), with
its refusals written in Anthropic's shape (`errors.py`). The body is translated into the
chat request (`translate.py`) and planned by the one chat path (`chat.plan_chat`: template,
tools, grammar, reasoning), so a conversation renders to the same prompt on both routes.
`count_tokens` renders the same prompt and counts it with the api's tokenizer (no
generation): it equals the `usage.input_tokens` of the same body sent to `/v1/messages`.
The `anthropic-version` and `anthropic-beta` headers are accepted and not read.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from services.api.chat import ChatPlan, plan_chat
from services.api.chat_request import with_prompt
from services.api.dialects.messages.errors import error_response
from services.api.dialects.messages.reply import MessagesReply
from services.api.dialects.messages.schemas import (
    MessagesCountTokensRequest,
    MessagesInput,
    MessagesRequest,
    MessagesTokenCount,
)
from services.api.dialects.messages.translate import translate
from services.api.errors import ApiError, internal_error, invalid
from services.api.serving import Prepared, api_state, json_response, read_body, serve
from services.api.state import ApiState
from services.api.streaming import EventStream
from services.api.validation import decode_json_object, load


def _plan(req: MessagesInput, state: ApiState) -> ChatPlan:
    template = state.chat_template.source if state.chat_template is not None else None
    translated = translate(req, state.settings.model_name, template, bool(state.settings.image_placeholder))
    plan = plan_chat(translated.req, translated.messages, state)
    if not translated.prefill:
        return plan
    at = f"messages.{len(req.messages) - 1}"
    if plan.tools_forced or plan.reasoning is not None:
        why = "tool_choice forces a call" if plan.tools_forced else "the served model's template thinks"
        raise invalid(at, f"{at}: a final assistant message (a prefill) cannot be continued here: {why}")
    return plan._replace(req=with_prompt(plan.req, (plan.req.params.prompt or "") + translated.prefill))


def _prompt_tokens(plan: ChatPlan, state: ApiState) -> int:
    return len(state.tokenizer.encode(plan.req.params.prompt or "", add_special_tokens=False).ids)


def _accept(obj: dict[str, Any], state: ApiState) -> Prepared:
    plan = _plan(load(obj, MessagesRequest), state)
    params = plan.req.params
    # a stream's message_start reports the prompt's tokens before the workers count them
    # (the message_delta at its end carries their count; they agree for a text prompt)
    tokens = _prompt_tokens(plan, state) if plan.req.stream else 0
    reply = MessagesReply(params.request_id, state.settings.model_name, input_tokens=tokens,
                          tool_format=plan.tool_format, tools_forced=plan.tools_forced, reasoning=plan.reasoning)
    return Prepared(params, plan.req.stream, reply)


async def messages(request: Request) -> Response | EventStream:
    """POST /v1/messages."""
    return await serve(request, _accept, "/v1/messages", errors=error_response)


def count_body(obj: dict[str, Any], state: ApiState) -> MessagesTokenCount:
    """A count_tokens body -> the prompt's token count, as `/v1/messages` would send it."""
    plan = _plan(load(obj, MessagesCountTokensRequest), state)
    if plan.req.params.image_refs:
        raise invalid(plan.req.params.image_refs[0].param, "count_tokens counts no image rows; send the request to "
                      "/v1/messages (its usage.input_tokens counts them)")
    return MessagesTokenCount(_prompt_tokens(plan, state))


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens."""
    state = api_state(request)
    try:
        body = decode_json_object(await read_body(request, state.settings.max_body_bytes))
        return json_response(count_body(body, state))
    except ApiError as err:
        return error_response(err)
    except Exception as exc:
        return error_response(internal_error("serving /v1/messages/count_tokens", exc))
