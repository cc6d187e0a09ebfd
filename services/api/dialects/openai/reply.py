"""OpenAI response objects built from a generation's delta / done events.

The engine side (`Generation`) knows nothing of OpenAI: it yields the same `DeltaEvent`s
and `DoneEvent` for every route, and these classes turn them into `text_completion` /
`chat.completion` objects, or into SSE chunks with OpenAI's framing:
- chat: a first chunk with `delta: {"role": "assistant", "content": ""}`, then one chunk
  per delta with text (deltas that only carry ids are not sent), then a chunk with an
  empty delta and the finish reason;
- completions: one chunk per delta with text, then one with `""` and the finish reason
  (with `echo`, the prompt text is the first chunk's text);
- with `stream_options.include_usage`, every chunk has `"usage": null` and a last chunk
  has `"choices": []` and the usage; then `data: [DONE]`.
- an error after the stream began is `data: {"error": {...}}` (which the openai client
  raises as an APIError), then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from services.api.answer import AnswerStream, read_answer
from services.api.dialects.openai.chat_audio import SpeechOut, audio_delta, audio_message
from services.api.errors import ApiError
from services.api.events import DeltaEvent, DoneEvent, encode, floor
from services.api.tools import ToolCall, ToolCallDelta
from shared.frames import TokenLogprobs

DONE_LINE = b"data: [DONE]\n\n"


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OpenAIUsage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: OpenAI's: the prompt tokens the prefix cache served (the openai SDK reads it); shown
    #: with --enable-prompt-tokens-details, as vLLM does
    prompt_tokens_details: PromptTokensDetails | None = None


def cached_details(cached: int | None) -> PromptTokensDetails | None:
    return None if cached is None else PromptTokensDetails(cached)


def usage_of(done: DoneEvent) -> OpenAIUsage:
    u = done.usage
    return OpenAIUsage(u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens,
                       cached_details(u.cached_tokens))


class CompletionLogprobs(msgspec.Struct):
    """OpenAI's (and vLLM's) completions logprobs object: per token its text, its logprob,
    a dict of the token and the `logprobs` most likely ones (text -> logprob), and the
    character offset where its text starts."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's `Logprob` of one token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    #: vLLM's: the stop string or stop token id that ended the choice (null otherwise)
    stop_reason: int | str | None = None
    #: vLLM's extension, when the request computed them (`prompt_logprobs`, or `echo` with
    #: `logprobs`): per prompt position (the first null) the token's and the top ones',
    #: keyed by token id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class Completion(msgspec.Struct):
    """`text_completion`: the reply and each stream chunk of `/v1/completions`."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: OpenAIUsage | UnsetType | None = UNSET


class ChatMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET
    #: a reasoning model's thinking (vLLM's field), split from `content`
    reasoning_content: str | UnsetType = UNSET
    #: speech out (`chat_audio.audio_message`): the clip of the reply, with its transcript
    audio: dict[str, Any] | UnsetType = UNSET


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    #: speech out: a chunk of the clip (`chat_audio.audio_delta`)
    audio: dict[str, Any] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: OpenAIUsage | UnsetType | None = UNSET


class TokenText:
    """Each token's own text, as vLLM shows it in logprobs: the token decoded alone."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False) if self._tok is not None else ""
            self._cache[token_id] = text
        return text


def completion_logprobs(text_of: TokenText, ids: Sequence[int], lps: Sequence[TokenLogprobs | None], k: int,
                        offset: int = 0) -> CompletionLogprobs:
    """The logprobs object of `ids` (a None entry: no logprob, the prompt's first token);
    `top_logprobs` holds the token itself and the `k` most likely, at most k + 1 entries."""
    out = CompletionLogprobs([], [], [], [])
    for tok, lp in zip(ids, lps):
        token = text_of(tok)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(floor(lp.logprob))
        entries = [(tok, lp.logprob), *((i, v) for i, v in zip(lp.top_ids, lp.top_logprobs) if i != tok)]
        out.top_logprobs.append({text_of(i): floor(v) for i, v in entries[: k + 1]})
    return out


def prompt_logprobs(text_of: TokenText, ids: Sequence[int], lps: Sequence[TokenLogprobs]) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then per token a dict from token id
    to its logprob, rank and text: the prompt's own token first, then the most likely."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    for tok, lp in zip(ids[1:], lps):
        entry = {str(tok): PromptLogprob(floor(lp.logprob), lp.rank, text_of(tok))}
        for rank, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1):
            entry.setdefault(str(i), PromptLogprob(floor(v), rank, text_of(i)))
        out.append(entry)
    return out


def chat_logprobs(text_of: TokenText, ids: Sequence[int], lps: Sequence[TokenLogprobs]) -> ChatLogprobs:
    """`logprobs.content`: per token its text, logprob and UTF-8 bytes, and the
    `top_logprobs` most likely tokens (most likely first)."""
    content = []
    for tok, lp in zip(ids, lps):
        token = text_of(tok)
        top = [ChatTopLogprob(text_of(i), floor(v), list(text_of(i).encode("utf-8", errors="replace")))
               for i, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(ChatTokenLogprob(token, floor(lp.logprob), list(token.encode("utf-8", errors="replace")), top))
    return ChatLogprobs(content)


def _stop_reason(done: DoneEvent) -> int | str | None:
    return None if done.stop_reason is UNSET else done.stop_reason


def _data(obj: msgspec.Struct) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


def error_chunk(err: ApiError) -> bytes:
    return b"data: " + encode(err.body()) + b"\n\n"


class CompletionReply:
    """Answers one `/v1/completions` request, as JSON or as SSE chunks. With `logprobs`
    (a count of alternatives), every choice carries the logprobs object of its tokens, the
    echoed prompt's first (its first token has none)."""

    def __init__(self, request_id: str, model: str, created: int, *, include_usage: bool = False,
                 echo: str = "", tokenizer: Any = None, logprobs: int | None = None, index: int = 0,
                 final_usage: bool = True) -> None:
        self.id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.index = index
        self._final_usage = final_usage  # False: one choice of several (`ManyReply` sends the usage)
        self._echo = echo
        self._echoing = bool(echo)
        self._usage: OpenAIUsage | UnsetType | None = None if include_usage else UNSET
        self._text_of = TokenText(tokenizer)
        self._k = logprobs
        self._sent = 0  # characters streamed so far: the text_offset of the next chunk

    def _logprobs(self, event: DeltaEvent | DoneEvent, prompt: bool, offset: int = 0) -> CompletionLogprobs | None:
        """The logprobs object of the event's tokens (of the echoed prompt's tokens first
        when `prompt`), None when none were asked."""
        if self._k is None:
            return None
        ids: list[int] = []
        lps: list[TokenLogprobs | None] = []
        if prompt and event.prompt_token_ids is not UNSET and event.prompt_logprobs is not UNSET:
            ids, lps = list(event.prompt_token_ids), [None, *event.prompt_logprobs]
        if event.logprobs is not UNSET:
            ids += event.token_ids
            lps += event.logprobs
        return completion_logprobs(self._text_of, ids, lps, self._k, offset)

    def choice(self, done: DoneEvent) -> CompletionChoice:
        out = CompletionChoice(self.index, self._echo + done.text, done.finish_reason,
                               self._logprobs(done, self._echoing), _stop_reason(done))
        if done.prompt_logprobs is not UNSET and done.prompt_token_ids is not UNSET:
            out.prompt_logprobs = prompt_logprobs(self._text_of, done.prompt_token_ids, done.prompt_logprobs)
        return out

    def wrap(self, choices: list, usage: OpenAIUsage | UnsetType | None) -> Completion:
        return Completion(self.id, self.created, self.model, choices, usage=usage)

    def json(self, done: DoneEvent) -> Completion:
        return self.wrap([self.choice(done)], usage_of(done))

    def _chunk(self, text: str, finish_reason: str | None, logprobs: CompletionLogprobs | None = None,
               stop_reason: int | str | None = None) -> bytes:
        self._sent += len(text)
        choice = CompletionChoice(self.index, text, finish_reason, logprobs, stop_reason)
        return _data(Completion(self.id, self.created, self.model, [choice], usage=self._usage))

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        out = b""
        if self._echoing:  # the prompt's text (and its tokens' logprobs) first, once
            self._echoing = False
            lps = None
            if self._k is not None and event.prompt_token_ids is not UNSET:
                lps = completion_logprobs(self._text_of, event.prompt_token_ids,
                                          [None, *(event.prompt_logprobs or [])], self._k)
            out = self._chunk(self._echo, None, lps)
        if type(event) is DeltaEvent:
            if event.text or (self._k is not None and event.token_ids):
                out += self._chunk(event.text, None, self._logprobs(event, False, self._sent))
            return out
        assert type(event) is DoneEvent
        out += self._chunk("", event.finish_reason, stop_reason=_stop_reason(event))
        if self.include_usage and self._final_usage:
            out += _data(self.wrap([], usage_of(event)))
        return out

    def error(self, err: ApiError) -> bytes:
        return error_chunk(err)

    def end(self) -> bytes:
        return DONE_LINE


class ChatReply:
    """Answers one `/v1/chat/completions` request, as JSON or as SSE chunks; with
    `logprobs` (the number of `top_logprobs`), `logprobs.content` for every token. A
    reasoning model's thinking goes to `reasoning_content` (`reasoning`: where the prompt
    left it, `services/api/reasoning.py`), and with tools the calls in the answer go to
    `tool_calls` (`tool_format`: how they are written, `services/api/tools.py`)."""

    def __init__(self, request_id: str, model: str, created: int, *, include_usage: bool = False,
                 tokenizer: Any = None, logprobs: int | None = None, index: int = 0,
                 final_usage: bool = True, tool_format: str | None = None, tools_forced: bool = False,
                 reasoning: str | None = None, speech: SpeechOut | None = None) -> None:
        self.id = request_id
        #: speech out's voice and format (None: text only)
        self.speech = speech
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.index = index
        self._final_usage = final_usage
        self._usage: OpenAIUsage | UnsetType | None = None if include_usage else UNSET
        self._started = False
        self._text_of = TokenText(tokenizer)
        self._k = logprobs
        #: the format tool calls are parsed from (None: the request has no tools)
        self.tool_format = tool_format
        #: the prompt's thinking state (None: not a reasoning template)
        self.reasoning = reasoning
        self._answer = AnswerStream(reasoning, tool_format, tools_forced)

    def _logprobs(self, event: DeltaEvent | DoneEvent) -> ChatLogprobs | None:
        if self._k is None or event.logprobs is UNSET:
            return None
        return chat_logprobs(self._text_of, event.token_ids, event.logprobs)

    def choice(self, done: DoneEvent) -> ChatChoice:
        answer = read_answer(done.text, self.reasoning, self.tool_format)
        reasoning_content: str | UnsetType = UNSET if answer.thinking is None else answer.thinking
        if answer.calls:
            return ChatChoice(self.index, ChatMessage(answer.content, tool_calls=answer.calls,
                                                      reasoning_content=reasoning_content),
                              "tool_calls", self._logprobs(done), _stop_reason(done))
        message = ChatMessage(answer.content, reasoning_content=reasoning_content)
        if self.speech is not None:
            message.audio = audio_message(self.speech, self.id, done.audio or b"", answer.content)
        return ChatChoice(self.index, message, done.finish_reason, self._logprobs(done), _stop_reason(done))

    def wrap(self, choices: list, usage: OpenAIUsage) -> ChatCompletion:
        return ChatCompletion(self.id, self.created, self.model, choices, usage)

    def json(self, done: DoneEvent) -> ChatCompletion:
        return self.wrap([self.choice(done)], usage_of(done))

    def _chunk(self, delta: ChatDelta, finish_reason: str | None, logprobs: ChatLogprobs | None = None,
               stop_reason: int | str | None = None) -> bytes:
        chunk = ChatCompletionChunk(self.id, self.created, self.model,
                                    [ChatChunkChoice(self.index, delta, finish_reason, logprobs, stop_reason)],
                                    usage=self._usage)
        return _data(chunk)

    def _parts(self, thinking: str, answer: str) -> bytes:
        """Chunks for text cut into thinking and answer (already through the tool-call hold-back)."""
        out = b""
        if thinking:
            out += self._chunk(ChatDelta(reasoning_content=thinking), None)
        if answer:
            out += self._chunk(ChatDelta(content=answer), None)
        return out

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            out = self._chunk(ChatDelta(role="assistant", content=""), None)
        if type(event) is DeltaEvent:
            if self._answer.plain:  # plain text: as it comes, with its logprobs
                if event.text or (self._k is not None and event.token_ids):
                    out += self._chunk(ChatDelta(content=event.text), None, self._logprobs(event))
            else:
                out += self._parts(*self._answer.feed(event.text))
            if self.speech is not None and event.audio:
                out += self._chunk(ChatDelta(audio=audio_delta(self.id, event.audio)), None)
            return out
        assert type(event) is DoneEvent
        finish = event.finish_reason
        thinking, rest, calls = self._answer.finish()
        out += self._parts(thinking, rest)
        if calls:
            out += self._chunk(ChatDelta(tool_calls=[ToolCallDelta(i, c.id, c.function) for i, c in enumerate(calls)]),
                               None)
            finish = "tool_calls"
        out += self._chunk(ChatDelta(), finish, stop_reason=_stop_reason(event))
        if self.include_usage and self._final_usage:
            out += _data(ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage_of(event)))
        return out

    def error(self, err: ApiError) -> bytes:
        return error_chunk(err)

    def end(self) -> bytes:
        return DONE_LINE


class ManyReply:
    """Answers a request of several choices (`n` > 1, a list of prompts): choice i is
    `replies[i]`'s, events come `Indexed`. Usage counts each prompt once (`firsts`: the
    choices that are a prompt's first sample) and every choice's tokens, as vLLM does."""

    def __init__(self, replies: Sequence[CompletionReply] | Sequence[ChatReply], firsts: set[int]) -> None:
        self.replies: Sequence[CompletionReply | ChatReply] = replies
        self.firsts = firsts
        self._dones: dict[int, DoneEvent] = {}

    def _usage(self, dones: dict[int, DoneEvent]) -> OpenAIUsage:
        prompt = sum(d.usage.prompt_tokens for i, d in dones.items() if i in self.firsts)
        completion = sum(d.usage.completion_tokens for d in dones.values())
        cached = [d.usage.cached_tokens for i, d in dones.items() if i in self.firsts]
        shown = None if None in cached else sum(c or 0 for c in cached)
        return OpenAIUsage(prompt, completion, prompt + completion, cached_details(shown))

    def json(self, dones: list[DoneEvent]) -> msgspec.Struct:
        choices = [r.choice(d) for r, d in zip(self.replies, dones)]
        return self.replies[0].wrap(choices, self._usage(dict(enumerate(dones))))

    def event(self, item: Any) -> bytes:
        out = self.replies[item.index].event(item.event)
        if type(item.event) is DoneEvent:
            self._dones[item.index] = item.event
            first = self.replies[0]
            if len(self._dones) == len(self.replies) and first.include_usage:
                out += _data(first.wrap([], self._usage(self._dones)) if isinstance(first, CompletionReply)
                             else ChatCompletionChunk(first.id, first.created, first.model, [],
                                                      usage=self._usage(self._dones)))
        return out

    def error(self, err: ApiError) -> bytes:
        return error_chunk(err)

    def end(self) -> bytes:
        return DONE_LINE
