"""Anthropic Messages bodies, replies and stream events, as msgspec Structs.

Request Structs are `schemas.Body` subclasses, so an unknown field (and an unknown content
block `type`, a tagged union member) is a 400 naming it; `validation.load` decodes them and
phrases msgspec's error, and `errors.py` writes its path as Anthropic does
(`messages.1.content.0.tool_use_id`). Every name carries `Messages` so the components of
`/openapi.json` never collide with the other dialects' (the document keys them by class name).

What is accepted and not acted on (it cannot change the output): `cache_control` on blocks,
tools and system text (the prefix cache is automatic), `metadata.user_id`, `service_tier`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.api.schemas import END, MAX_TOOLS, NAME_RE, Body, MaxTokens, NonEmpty, StopString, TopP

#: stop sequences per request (Anthropic documents no limit; this bounds the per-delta
#: hold-back scan of `stop.StopMatcher`)
MAX_STOP_SEQUENCES = 16
#: Anthropic's smallest thinking budget
MIN_THINKING_BUDGET = 1024

# ---- request ---------------------------------------------------------------------------------


class MessagesCacheControl(Body):
    """Anthropic's prompt-caching marker: accepted, not needed (prefix caching is automatic)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


#: a field of the SDK's reply objects that a client may send back in the history as null
#: (`model_dump()` of a reply block writes it)
SdkNull = Annotated[None, Meta(description="null (a reply block's field, sent back unchanged)")]


class MessagesTextParam(Body, tag_field="type", tag="text"):
    """A text block."""

    text: str
    cache_control: MessagesCacheControl | None = None
    citations: SdkNull = None


class MessagesBase64Source(Body, tag_field="type", tag="base64"):
    """An image's file, base64 (it becomes a `data:` URL on the api's image path)."""

    media_type: Annotated[Literal["image/jpeg", "image/png", "image/gif", "image/webp"],
                          Meta(description="image/jpeg, image/png, image/gif or image/webp")]
    data: Annotated[str, Meta(min_length=1, description="the image file, base64")]


class MessagesUrlSource(Body, tag_field="type", tag="url"):
    """An image by URL (http(s), or file:// under --allowed-local-media-path)."""

    url: NonEmpty


class MessagesImageParam(Body, tag_field="type", tag="image"):
    """An image block (vision models only: another model refuses it naming the block)."""

    source: Annotated[MessagesBase64Source | MessagesUrlSource,
                      Meta(description='{"type": "base64", "media_type", "data"} or {"type": "url", "url"}')]
    cache_control: MessagesCacheControl | None = None


class MessagesToolUseParam(Body, tag_field="type", tag="tool_use"):
    """A call the assistant made, in the history (a chat `tool_calls` entry)."""

    id: NonEmpty
    name: NonEmpty
    input: Annotated[dict[str, Any], Meta(description="the call's arguments, an object")]
    cache_control: MessagesCacheControl | None = None
    caller: SdkNull = None
    toolset_name: SdkNull = None


class MessagesToolResultParam(Body, tag_field="type", tag="tool_result"):
    """A user turn's answer to an earlier `tool_use` (a chat `tool` message)."""

    tool_use_id: Annotated[str, Meta(min_length=1, description="the id of an earlier tool_use block")]
    content: Annotated[str | list[MessagesTextParam],
                       Meta(description="a string or a list of text blocks")] | None = None
    is_error: bool | None = None
    cache_control: MessagesCacheControl | None = None


class MessagesThinkingParam(Body, tag_field="type", tag="thinking"):
    """A thinking block of an earlier assistant turn: accepted and left out of the prompt
    (chat templates drop earlier turns' thinking)."""

    thinking: str
    signature: str | None = None


MessagesContentBlock = (MessagesTextParam | MessagesImageParam | MessagesToolUseParam | MessagesToolResultParam
                        | MessagesThinkingParam)


class MessagesMessageParam(Body):
    """One turn: `content` a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: Annotated[str | list[MessagesContentBlock], Meta(description="a string or a list of content blocks")]


class MessagesToolParam(Body):
    """A client tool: its arguments' JSON schema is `input_schema` (type object)."""

    name: Annotated[str, Meta(pattern=f"^{NAME_RE.pattern}{END}", description="1-64 characters of [A-Za-z0-9_.-]")]
    input_schema: Annotated[dict[str, Any], Meta(description='a JSON schema object with "type": "object"')]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: MessagesCacheControl | None = None


class MessagesToolChoiceAuto(Body, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool | None = None


class MessagesToolChoiceAny(Body, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool | None = None


class MessagesToolChoiceTool(Body, tag_field="type", tag="tool"):
    name: NonEmpty
    disable_parallel_tool_use: bool | None = None


class MessagesToolChoiceNone(Body, tag_field="type", tag="none"):
    pass


MessagesToolChoice = MessagesToolChoiceAuto | MessagesToolChoiceAny | MessagesToolChoiceTool | MessagesToolChoiceNone


class MessagesThinkingEnabled(Body, tag_field="type", tag="enabled"):
    """Thinking on: only for a model whose template thinks; the budget is checked as
    Anthropic checks it (>= 1024, below max_tokens), and max_tokens bounds the whole reply."""

    budget_tokens: Annotated[int, Meta(ge=MIN_THINKING_BUDGET, description=f"an integer >= {MIN_THINKING_BUDGET}")]


class MessagesThinkingDisabled(Body, tag_field="type", tag="disabled"):
    """Thinking off (a thinking template is rendered with `enable_thinking: false`)."""


MessagesThinking = MessagesThinkingEnabled | MessagesThinkingDisabled


class MessagesMetadata(Body):
    user_id: Annotated[str, Meta(max_length=256)] | None = None


class MessagesInput(Body):
    """What a prompt is made of: the fields `/v1/messages` and `/v1/messages/count_tokens` share."""

    model: NonEmpty
    messages: Annotated[list[MessagesMessageParam], Meta(min_length=1, description="a non-empty list of messages")]
    system: Annotated[str | list[MessagesTextParam], Meta(description="a string or a list of text blocks")] | None = (
        None)
    tools: Annotated[list[MessagesToolParam], Meta(max_length=MAX_TOOLS, extra={"noun": "tools"})] | None = None
    tool_choice: Annotated[MessagesToolChoice,
                           Meta(description='{"type": "auto" | "any" | "tool" | "none"}')] | None = None
    thinking: Annotated[MessagesThinking, Meta(description='{"type": "enabled", "budget_tokens"} or '
                                                            '{"type": "disabled"}')] | None = None


class MessagesRequest(MessagesInput, kw_only=True):
    """`POST /v1/messages`. `max_tokens` is required, as in Anthropic's API."""

    max_tokens: MaxTokens
    stop_sequences: Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES,
                                                     extra={"noun": "stop sequences"})] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Meta(ge=0, le=1, description="a number in [0, 1] (0 = greedy)")] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0, description="an integer >= 0 (0 = off)")] | None = None
    metadata: MessagesMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


class MessagesCountTokensRequest(MessagesInput):
    """`POST /v1/messages/count_tokens`: the prompt's fields of a `/v1/messages` body."""


# ---- reply -----------------------------------------------------------------------------------


class MessagesTextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class MessagesThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    """A reasoning model's thinking; `signature` is "" (nothing here signs it)."""

    thinking: str
    signature: str = ""


class MessagesToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


MessagesBlock = MessagesTextBlock | MessagesThinkingBlock | MessagesToolUseBlock


class MessagesUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(msgspec.Struct, tag_field="type", tag="message"):
    """The `message` object: the reply of `/v1/messages` (and, with no content yet, of the
    stream's `message_start`)."""

    id: str
    model: str
    content: list[MessagesBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage
    role: str = "assistant"


class MessagesTokenCount(msgspec.Struct):
    """The reply of `/v1/messages/count_tokens`."""

    input_tokens: int


class MessagesErrorObject(msgspec.Struct):
    type: str
    message: str


class MessagesError(msgspec.Struct, tag_field="type", tag="error"):
    """Anthropic's error body (and the stream's `error` event)."""

    error: MessagesErrorObject


# ---- stream events ---------------------------------------------------------------------------


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    signature: str


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: MessagesResponse


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: MessagesBlock


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDeltaBody(msgspec.Struct):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    """The end of the reply: why it stopped, and the usage (cumulative: the SDK overwrites)."""

    delta: MessageDeltaBody
    usage: MessagesUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


StreamEvent = (MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
               | MessageStop | MessagesError)
