"""The one chat path every dialect takes: a validated chat request and its messages ->
the prompt (the checkpoint's chat template), the tools' format and grammar, and where a
reasoning template leaves the thinking.

`/v1/chat/completions` (OpenAI), `/v1/responses` (OpenAI Responses) and `/v1/messages`
(Anthropic Messages) differ in how a body is read and how the answer is written; each
translates its body into a chat request (`chat_request.parse_chat`'s `ChatRequest` and
plain-dict messages) and calls `plan_chat`, so the template, the tool formats, the
reasoning split and the structured-output grammar are one code in all three.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from services.api.chat_request import ChatRequest, with_grammar, with_prompt, with_specials_kept
from services.api.errors import ApiError, invalid
from services.api.harmony import answer_grammar, call_grammar, is_harmony
from services.api.reasoning import HARMONY, after_thinking, prompt_state, thinks
from services.api.state import ApiState, task_refusal
from services.api.tools import pick_format, prepare_messages, tool_grammar
from shared.errors import ErrorKind


class ChatPlan(NamedTuple):
    """A chat request ready to generate, and what its reply needs to read the answer."""

    #: the request with its rendered prompt (and its grammar, for forced tool calls)
    req: ChatRequest
    #: how tool calls are written in the answer (None: the request has no tools)
    tool_format: str | None
    #: tool_choice required or a named function: the answer is calls only
    tools_forced: bool
    #: where the prompt leaves a reasoning template's thinking (None: not a reasoning template)
    reasoning: str | None


def plan_chat(req: ChatRequest, messages: list[dict[str, Any]], state: ApiState,
              messages_param: str = "messages") -> ChatPlan:
    """Render `messages` with the served model's chat template; `messages_param` names the
    dialect's field in a refusal (a model without a chat template)."""
    settings = state.settings
    if settings.task not in ("generate", "speech"):  # an embedding or scoring model: name its task and routes
        raise invalid("model", task_refusal(settings.model_name, settings.task, "generate"))
    if state.chat_template is None:
        raise ApiError(ErrorKind.INVALID, f"the model `{state.settings.model_name}` has no chat template; "
                       "use /v1/completions with a formatted prompt", messages_param)
    if is_harmony(state.chat_template.source):
        return _plan_harmony(req, messages, state)
    fmt, native = pick_format(state.chat_template.source, state.settings.tool_call_parser)
    tools = req.tools
    if tools is not None and tools.forced:
        req = with_grammar(req, tool_grammar(tools, fmt))
    messages = prepare_messages(messages, tools, fmt, native)
    listed = tools.tools if tools is not None and native else None
    req = with_prompt(req, state.chat_template.render(messages, tools=listed, extra=req.template_kwargs))
    reasoning = prompt_state(req.params.prompt or "") if thinks(state.chat_template.source) else None
    if reasoning is not None and req.params.sampling.grammar is not None:  # the constraint binds the answer
        req = with_grammar(req, after_thinking(req.params.sampling.grammar, reasoning), check=None)
    return ChatPlan(req, fmt if tools is not None else None, tools is not None and tools.forced, reasoning)


def _plan_harmony(req: ChatRequest, messages: list[dict[str, Any]], state: ApiState) -> ChatPlan:
    """A harmony template's chat (gpt-oss): the template renders the tools, past calls and
    results itself (an assistant turn's `reasoning_content` is its `thinking`, as llama.cpp
    passes it); the reply keeps its special tokens, whose channels `harmony.py` reads.
    A structured output binds the `final` channel's body and a forced call the call message,
    each after an analysis message the model may write first (`harmony.answer_grammar`,
    `call_grammar`)."""
    if req.params.sampling.grammar is not None:
        req = with_grammar(req, answer_grammar(req.params.sampling.grammar), check=None)
    if req.tools is not None and req.tools.forced:
        req = with_grammar(req, call_grammar(req.tools))
    turns = [_harmony_turn(m) for m in messages]
    listed = req.tools.tools if req.tools is not None else None
    assert state.chat_template is not None
    req = with_prompt(req, state.chat_template.render(turns, tools=listed, extra=req.template_kwargs))
    return ChatPlan(with_specials_kept(req), HARMONY if req.tools is not None else None, False, HARMONY)


def _harmony_turn(message: dict[str, Any]) -> dict[str, Any]:
    """A message as gpt-oss's template reads it: an assistant turn's reasoning as `thinking`,
    and no `content` key where there is none (the template tests `"content" in message`,
    then reads it as text)."""
    turn = {k: v for k, v in message.items() if not (k == "content" and v is None)}
    if turn.get("role") == "assistant" and isinstance(turn.get("reasoning_content"), str):
        turn["thinking"] = turn["reasoning_content"]
    return turn
