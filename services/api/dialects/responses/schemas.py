"""The shapes of OpenAI's Responses API as msgspec Structs: the request body and its input
items (decoded strictly: an unknown field or item type is a 400 naming it), and the
response object, its output items and its stream events (encoded as OpenAI writes them,
so the `openai` SDK's pydantic models parse them: `responses.create`, `.stream`, `.parse`).

Names start with `Responses` / `Resp` because `/openapi.json` lists every Struct by its
class name, next to chat's and the Messages dialect's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.api.schemas import (
    END,
    MAX_TOOLS,
    NAME_RE,
    Body,
    JsonSchema,
    MaxTokens,
    Metadata,
    ServiceTier,
    Temperature,
    TopP,
)

# ---- input items ---------------------------------------------------------------------------


class ResponsesInputText(Body, tag_field="type", tag="input_text"):
    """Text a user (or system / developer) wrote."""

    text: str


class ResponsesOutputTextPart(Body, tag_field="type", tag="output_text"):
    """Text the assistant wrote (an earlier response's output sent back as input)."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponsesRefusalPart(Body, tag_field="type", tag="refusal"):
    """An assistant's refusal sent back as input: read as its text."""

    refusal: str


class ResponsesInputImage(Body, tag_field="type", tag="input_image"):
    """An image by URL (vision models only; another model refuses it naming the part)."""

    image_url: Annotated[str, Meta(min_length=1, description="a data: URL (base64), an http(s) URL, or a file:// "
                                                             "URL under --allowed-local-media-path")] | None = None
    file_id: Annotated[None, Meta(description="null: this server keeps no files; give image_url")] = None
    detail: Annotated[Literal["auto"], Meta(description='"auto" only: the model\'s processor sets the '
                                                        "resolution")] | None = None


#: a content part of a message item, tagged by `type`
ResponsesContentPart = ResponsesInputText | ResponsesOutputTextPart | ResponsesRefusalPart | ResponsesInputImage
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponsesMessageItem(Body, tag_field="type", tag="message"):
    """A message: a string or a list of content parts. An item with `role` and no `type`
    is one of these (OpenAI's "easy" input message)."""

    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[ResponsesContentPart], Meta(description="a string or a list of content parts")]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class ResponsesFunctionCallItem(Body, tag_field="type", tag="function_call"):
    """A call the assistant made (an earlier response's output sent back): `arguments` is
    a JSON object as text."""

    call_id: Annotated[str, Meta(min_length=1, description="a non-empty string")]
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class ResponsesFunctionCallOutputItem(Body, tag_field="type", tag="function_call_output"):
    """The result of the call `call_id`, as text (or input_text parts, joined)."""

    call_id: Annotated[str, Meta(min_length=1, description="a non-empty string")]
    output: Annotated[str | list[ResponsesInputText], Meta(description="a string or a list of input_text parts")]
    id: str | None = None
    status: ItemStatus | None = None


class ResponsesSummaryText(Body, tag_field="type", tag="summary_text"):
    text: str


class ResponsesReasoningText(Body, tag_field="type", tag="reasoning_text"):
    text: str


class ResponsesReasoningItem(Body, tag_field="type", tag="reasoning"):
    """A reasoning item sent back (clients replay a response's output whole): accepted and
    left out of the prompt, as chat templates drop earlier turns' thinking."""

    id: str | None = None
    summary: list[ResponsesSummaryText] | None = None
    content: list[ResponsesReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


#: an item of `input`, tagged by `type`
ResponsesInputItem = (ResponsesMessageItem | ResponsesFunctionCallItem | ResponsesFunctionCallOutputItem
                      | ResponsesReasoningItem)

# ---- tools, tool_choice, text, reasoning -----------------------------------------------------


class ResponsesFunctionTool(Body, tag_field="type", tag="function"):
    """A function the model may call (the only tool type this server runs)."""

    name: Annotated[str, Meta(pattern=f"^{NAME_RE.pattern}{END}", description="1-64 characters of [A-Za-z0-9_.-]")]
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(description="a JSON schema object")] | None = None
    strict: bool | None = None


class ResponsesToolChoiceFunction(Body, tag_field="type", tag="function"):
    """`{"type": "function", "name": ...}`: that function must be called."""

    name: str


ResponsesToolChoice = Annotated[Literal["none", "auto", "required"] | ResponsesToolChoiceFunction, Meta(
    description='"none", "auto", "required" or {"type": "function", "name": ...}')]


class ResponsesTextFormatText(Body, tag_field="type", tag="text"):
    """Free text (the default)."""


class ResponsesTextFormatJsonObject(Body, tag_field="type", tag="json_object"):
    """Any JSON object."""


class ResponsesTextFormatJsonSchema(Body, tag_field="type", tag="json_schema"):
    """JSON matching `schema` (compiled by `services/api/structured.py`, as chat's
    `response_format`)."""

    schema: JsonSchema
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


ResponsesTextFormat = ResponsesTextFormatText | ResponsesTextFormatJsonObject | ResponsesTextFormatJsonSchema


class ResponsesTextConfig(Body):
    """`text`: the answer's format; `verbosity` is a hint a local model has no switch for
    (accepted, not acted on)."""

    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ResponsesReasoningConfig(Body):
    """`reasoning`: `effort` reaches the chat template as `reasoning_effort` (templates
    that read it, gpt-oss style, honour it; others ignore it); summaries are not written
    (`summary` accepted, reasoning items carry the thinking in `content`)."""

    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(Body):
    include_obfuscation: bool | None = None


#: what `include` may name: all accepted, none adds anything (no hosted tools run here,
#: reasoning is not encrypted); `message.output_text.logprobs` is refused in `translate.py`
Includable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs"]

ResponsesInput = Annotated[str | list[ResponsesInputItem], Meta(description="a string or a list of input items")]


class ResponsesRequest(Body):
    """`POST /v1/responses`."""

    model: str | None = None
    input: ResponsesInput | None = None
    instructions: str | None = None
    tools: Annotated[list[ResponsesFunctionTool], Meta(max_length=MAX_TOOLS, extra={"noun": "tools"})] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, description="a non-empty string")] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    reasoning: ResponsesReasoningConfig | None = None
    truncation: Annotated[Literal["disabled"], Meta(description='"disabled" only: a prompt too long is a 400, '
                                                                "never cut")] | None = None
    include: list[Includable] | None = None
    background: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=0, description="0 (logprobs are not given)")] | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None


# ---- the response object and its output items -------------------------------------------------


class RespOutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class RespOutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[RespOutputText]
    role: str = "assistant"


class RespFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: str = "completed"


class RespSummaryText(msgspec.Struct, tag_field="type", tag="summary_text"):
    text: str


class RespReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class RespReasoning(msgspec.Struct, tag_field="type", tag="reasoning"):
    """A reasoning template's thinking: in `content` (there is no separate summary)."""

    id: str
    summary: list[RespSummaryText]
    content: list[RespReasoningText]
    status: str = "completed"


RespOutputItem = RespOutputMessage | RespFunctionCall | RespReasoning


class RespInputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class RespOutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class RespUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: RespInputTokensDetails
    output_tokens_details: RespOutputTokensDetails


class RespIncompleteDetails(msgspec.Struct):
    reason: str


class RespError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct):
    """OpenAI's `response` object, with the request's settings echoed."""

    id: str
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled"]
    model: str
    output: list[RespOutputItem]
    usage: RespUsage | None
    instructions: str | None
    tools: list[ResponsesFunctionTool]
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    text: ResponsesTextConfig
    reasoning: ResponsesReasoningConfig
    previous_response_id: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    user: str | None
    store: bool
    object: str = "response"
    error: RespError | None = None
    incomplete_details: RespIncompleteDetails | None = None
    completed_at: int | None = None
    truncation: str = "disabled"
    background: bool = False
    service_tier: str = "default"
    top_logprobs: int = 0


class ResponseDeleted(msgspec.Struct):
    """`DELETE /v1/responses/{id}`."""

    id: str
    object: str = "response"
    deleted: bool = True


# ---- stream events (each an SSE `event: <type>` line and its `data:`) --------------------------


class RespLifecycleEvent(msgspec.Struct):
    """response.created / .in_progress / .completed / .incomplete / .failed"""

    type: str
    sequence_number: int
    response: ResponseObject


class RespItemEvent(msgspec.Struct):
    """response.output_item.added / .done"""

    type: str
    sequence_number: int
    output_index: int
    item: RespOutputItem


class RespPartEvent(msgspec.Struct):
    """response.content_part.added / .done"""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: RespOutputText | RespReasoningText


class RespTextDeltaEvent(msgspec.Struct):
    """response.output_text.delta"""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class RespTextDoneEvent(msgspec.Struct):
    """response.output_text.done"""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class RespReasoningDeltaEvent(msgspec.Struct):
    """response.reasoning_text.delta"""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class RespReasoningDoneEvent(msgspec.Struct):
    """response.reasoning_text.done"""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class RespArgumentsDeltaEvent(msgspec.Struct):
    """response.function_call_arguments.delta"""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class RespArgumentsDoneEvent(msgspec.Struct):
    """response.function_call_arguments.done"""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class RespErrorEvent(msgspec.Struct):
    """error: a failure after the stream began (then response.failed)"""

    type: str
    sequence_number: int
    code: str | None
    message: str
    param: str | None
