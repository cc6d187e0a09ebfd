"""The declared shapes of the api's request bodies (and of its simple replies), as msgspec
Structs: the bottom of the api, imported by every route and dialect, importing none of
them (`openapi.py` publishes them as `/openapi.json`).

One declaration per route says a field's type, its bounds and whether unknown fields are
refused; decoding against it (`validation.load`) is the check, and `openapi.openapi()`
publishes the same declarations (`msgspec.json.schema_components`), so what a client
generates code from is what the server enforces. Adding a route is one line in
`openapi.ROUTES` (a dialect's: its package's `SHAPES`).

Conventions the checks rely on:
- a field a client may leave out is `X | None = None`: `null` means "not given";
- a `Meta(description=...)` is written as the requirement, because the 400 quotes it:
  "<field> must be <description>, got <value>". A type error, or a bound the description
  names, uses the description; a bound it does not name gets the generic wording ("an
  integer <= 2147483647"); `extra={"noun": ...}` names a list's items in "at most N <noun>";
- nested objects that today ignore unknown keys (`response_format`, tool calls in the
  history) do not set `forbid_unknown_fields`; every route body does;
- rules across fields, and limits only known at run time (the deployment's max_model_len,
  the vocabulary, the served model's name), are not declared here: `validation.py`,
  `chat_request.py`, `tokenization.py` and the conductor check them after decoding;
- fields of the OpenAI / vLLM APIs the engine does not honour are in `UNSUPPORTED`, not in
  a route's Struct: a request may send them only with a neutral value (`n: 1`,
  `tools: []`), and the document lists them with those values.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import msgspec
from msgspec import Meta

INT32_MAX = 2**31 - 1  # ceiling for counts and token ids: keeps every frame encodable
SEED_MAX = 2**63 - 1  # seeds must fit torch / numpy generators on every worker
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 512  # per stop string: bounds the per-delta hold-back scan
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs; OpenAI's chat allows 20)
MAX_PENALTY = 2  # presence / frequency penalties lie in [-2, 2] (OpenAI's range, vLLM's check)
MAX_LOGIT_BIAS = 100  # a logit_bias value lies in [-100, 100] (OpenAI's range)
MAX_STOP_TOKEN_IDS = 256  # bounds the per-token stop check
MAX_N = 16  # samples per prompt
MAX_TOOLS = 128
MAX_GUIDED_CHOICES = 1024
#: a string that is only one of these characters (a portable "end of string": `$` also
#: matches before a final newline in Python)
END = r"(?![\s\S])"
#: a function (tool) name: 1-64 characters of [A-Za-z0-9_.-], as OpenAI's API takes it
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# ---- field types shared by the routes ------------------------------------------------------

MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX, description=f"an integer in [0, {INT32_MAX}]")]
Temperature = Annotated[float, Meta(ge=0, description="a number >= 0 (0 = greedy)")]
TopP = Annotated[float, Meta(gt=0, le=1, description="a number in (0, 1]")]
TopK = Annotated[int, Meta(ge=-1, le=INT32_MAX, description="an integer >= 1, or 0 or -1 for off")]
Seed = Annotated[int, Meta(ge=0, le=SEED_MAX, description=f"an integer in [0, {SEED_MAX}]")]
Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY,
                                description=f"a number in [-{MAX_PENALTY}, {MAX_PENALTY}]")]
RepetitionPenalty = Annotated[float, Meta(gt=0, description="a number > 0 (1 = off)")]
MinP = Annotated[float, Meta(ge=0, le=1, description="a number in [0, 1]")]
LogitBias = Annotated[
    dict[Annotated[int, Meta(ge=0, le=INT32_MAX, description="keyed by a token id (a non-negative integer)")],
         Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS,
                               description=f"a number in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")]],
    Meta(description=f"an object mapping token ids to numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]",
         extra_json_schema={"propertyNames": {"pattern": "^[0-9]+$"}})]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS, extra={"noun": "token ids"},
                                             description=f"a list of up to {MAX_STOP_TOKEN_IDS} token ids")]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]")]
NonEmpty = Annotated[str, Meta(min_length=1, description="a non-empty string")]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS, description="a non-empty string")]
#: an empty stop string is refused rather than read as "no stop": it would match at once
Stop = Annotated[StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP, extra={"noun": "strings"})],
                 Meta(description=f"a string or a list of up to {MAX_STOP} strings")]
RequestId = Annotated[str, Meta(pattern=f"^[A-Za-z0-9._:-]{{1,128}}{END}",
                                description="a string of 1-128 characters from [A-Za-z0-9._:-]")]
ClientId = Annotated[str, Meta(min_length=1, max_length=128, description="a string of 1-128 characters")]
N = Annotated[int, Meta(ge=1, le=MAX_N)]
#: a language code ("en", "haw", "pt-BR") or a Whisper language token ("<|en|>"); whether
#: the model knows it is the data worker's answer (400 with param "language")
Language = Annotated[str, Meta(pattern=f"^(?:<\\|[A-Za-z_-]{{1,28}}\\|>|[A-Za-z_-]{{1,32}}){END}",
                               description='a language code such as "en" (letters, "-" or "_", 1-32 characters)')]
Task = Annotated[Literal["transcribe", "translate"], Meta(description='"transcribe" or "translate"')]
#: a JSON schema as an object (or `true` / `false`), or as its JSON text (vLLM takes both)
JsonSchema = Annotated[dict[str, Any] | bool | str, Meta(description="a JSON schema (an object, or its JSON text)")]
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)],
                          Annotated[str, Meta(max_length=512, description="a string of up to 512 characters")]],
                     Meta(max_length=16, extra={"noun": "entries"},
                          description="an object of at most 16 string values (keys up to 64 characters, values up "
                                      "to 512)")]
ServiceTier = Literal["auto", "default", "flex", "priority", "scale"]


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The base of every route body: keyword fields, unknown fields refused."""

    #: the body may carry the `UNSUPPORTED` fields with a neutral value (the routes that
    #: generate take them, as vLLM does; /tokenize and the WebSocket's cancel do not)
    takes_unsupported: ClassVar[bool] = False


# ---- the fields /generate and the OpenAI routes share -------------------------------------


class SamplingFields(Body):
    """temperature / top_p / top_k / seed / ignore_eos and vLLM's logits processors
    (honoured on every route that samples text)."""

    takes_unsupported: ClassVar[bool] = True
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    ignore_eos: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    logit_bias: LogitBias | None = None
    min_tokens: Count | None = None
    stop_token_ids: StopTokenIds | None = None


class TextFormat(msgspec.Struct, tag="text", tag_field="type"):
    """`response_format` text: no constraint."""


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type"):
    """`response_format` json_object: any JSON object."""


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    """OpenAI's `json_schema` object (other keys are ignored, as OpenAI's clients send more)."""

    schema: JsonSchema
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type"):
    """`response_format` json_schema: JSON matching `json_schema.schema`."""

    json_schema: Annotated[JsonSchemaSpec, Meta(description='an object with "name" and "schema"')]


#: OpenAI's `response_format`, tagged by `type`
ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
Regex = Annotated[str, Meta(min_length=1, description="a non-empty string (a regular expression)")]
Choices = Annotated[list[NonEmpty], Meta(min_length=1, max_length=MAX_GUIDED_CHOICES, extra={"noun": "strings"},
                                         description=f"a list of 1 to {MAX_GUIDED_CHOICES} non-empty strings")]
Grammar = Annotated[str, Meta(pattern=r"\S", description="a non-empty string (a Lark grammar, or GBNF with ::=)")]


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar,
    json_object; the other keys are vLLM's options, accepted and not needed here."""

    json: JsonSchema | None = None
    regex: Regex | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    backend: str | None = None


class ConstrainedFields(SamplingFields):
    """The sampling fields plus the structured-output constraint (`structured.py`; at most
    one per request)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Regex | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None


# ---- /generate, its WebSocket frames and its audio form ------------------------------------


class ContextTurn(Body):
    """One earlier turn of a conversation a speech model continues (CSM's voice
    continuation): the model hears the turns, then speaks the request's text."""

    speaker: Annotated[str, Meta(description="who spoke: one of the model's voices (/v1/models), as `voice` "
                                             "(CSM's; a model that clones the clip's voice reads none)")] = ""
    text: Annotated[str, Meta(max_length=4096, description="what the speaker said (absent: a Qwen3-TTS Base "
                                                           "checkpoint's reference clip alone, x-vector mode)")] = ""
    audio: Annotated[str, Meta(min_length=1, description="the turn's sound: a WAV or FLAC file, base64 (a data: URL "
                                                         "too); other rates than the model's are resampled; "
                                                         "absent: the text alone")] | None = None


#: a speech model's earlier turns, oldest first
Context = Annotated[list[ContextTurn], Meta(min_length=1, max_length=64, description=(
    "speech models that continue a conversation (CSM): its earlier turns, oldest first; the request's text is "
    "the next turn. Voice cloning (Higgs, Qwen3-TTS Base): the reference clip"))]


class GenerateRequest(ConstrainedFields):
    """`POST /generate` (DESIGN.md section 7): exactly one of `prompt` or `input_ids`."""

    prompt: NonEmpty | None = None
    input_ids: Annotated[list[TokenId], Meta(min_length=1, description="a non-empty list of integers >= 0")] | None = (
        None)
    max_tokens: MaxTokens | None = None
    stop: Stop | None = None
    stream: bool | None = None
    request_id: RequestId | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    images: Annotated[list[Annotated[str, Meta(min_length=1)]],
                      Meta(description="vision models: image URLs (data:, http(s), or file:// under "
                                       "--allowed-local-media-path), one per image placeholder in `prompt`, "
                                       "in order (`/v1/models` lists the model's placeholder)")] | None = None
    audios: Annotated[list[Annotated[str, Meta(min_length=1)]],
                      Meta(description="omni models: audio files, base64 (a data: URL too), one per audio "
                                       "placeholder in `prompt`, in order (`/v1/models` lists the model's "
                                       "placeholder)")] | None = None
    videos: Annotated[list[Annotated[str, Meta(min_length=1)]],
                      Meta(description="omni models: video files as data: URLs (data:video/mp4;base64,...), one "
                                       "per video placeholder in `prompt`, in order (`/v1/models` lists the "
                                       "model's placeholder)")] | None = None
    context: Context | None = None


class GenerateFrame(GenerateRequest, tag="generate", tag_field="type", kw_only=True):
    """A `/generate/ws` client frame that starts a request: the `/generate` fields plus the
    client's `id` (unique among the socket's live requests)."""

    id: ClientId


class CancelFrame(Body, tag="cancel", tag_field="type"):
    """A `/generate/ws` client frame that cancels the live request `id`."""

    id: ClientId


#: what a `/generate/ws` client sends, tagged by `type`
ClientFrame = GenerateFrame | CancelFrame
#: a field a form with an audio file may not carry: the audio is the prompt
NoPrompt = Annotated[None, Meta(description="absent when an audio file is sent: the audio is the prompt")]


class AudioGenerateForm(SamplingFields):
    """`POST /generate` as multipart/form-data for a speech model: the `file` part is the
    prompt; the other parts are the `/generate` fields (no grammar over a transcript)."""

    prompt: NoPrompt = None
    input_ids: NoPrompt = None
    max_tokens: MaxTokens | None = None
    stop: Stop | None = None
    stream: bool | None = None
    request_id: RequestId | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    language: Language | None = None
    task: Task | None = None


# ---- the OpenAI routes -----------------------------------------------------------------------


class StreamOptions(Body):
    """`stream_options` (only with `stream: true`)."""

    include_usage: bool | None = None


class OpenAIFields(ConstrainedFields):
    """What `/v1/completions` and `/v1/chat/completions` share. `user`, `metadata`, `store`,
    `service_tier`, `prompt_cache_key` and `safety_identifier` cannot change the output: they
    are type-checked (as OpenAI does) and not acted on."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


#: a prompt of `/v1/completions`: a string, token ids, or a list of either (a batch)
CompletionPrompt = Annotated[
    NonEmpty | Annotated[list[Annotated[
        NonEmpty | TokenId | Annotated[list[TokenId], Meta(min_length=1, description="a non-empty list of token ids")],
        Meta(description="a string, a token id or a list of token ids")]], Meta(min_length=1)],
    Meta(description="a string, a list of token ids, or a list of those")]


class CompletionRequest(OpenAIFields, kw_only=True):
    """`POST /v1/completions`. A list of prompts gives one choice per prompt (times `n`)."""

    prompt: CompletionPrompt
    echo: bool | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    n: N | None = None
    best_of: int | None = None


class TextPart(Body, tag_field="type", tag="text"):
    """A content part of text. Parts are a union tagged by `type` ("text", "image_url"):
    a part of another kind is a 400 naming its `type`."""

    text: str


class ImageUrl(Body):
    url: Annotated[str, Meta(min_length=1, description="a data: URL (base64), an http(s) URL, or a file:// URL "
                                                       "under --allowed-local-media-path")]
    detail: Annotated[Literal["auto"], Meta(description='"auto" only: the model\'s processor sets the '
                                                        "resolution")] | None = None


class ImageUrlPart(Body, tag_field="type", tag="image_url"):
    """An image (vision models only: another model refuses it naming the part)."""

    image_url: ImageUrl


class InputAudio(Body):
    data: Annotated[str, Meta(min_length=1, description="the audio file, base64")]
    format: Annotated[Literal["wav", "mp3", "flac", "ogg"], Meta(description="the file's container")]


class InputAudioPart(Body, tag_field="type", tag="input_audio"):
    """An audio input (omni models only: another model refuses it naming the part)."""

    input_audio: InputAudio


class VideoUrl(Body):
    url: Annotated[str, Meta(min_length=1, description="the video file as a data: URL (data:video/mp4;base64,...)")]


class VideoUrlPart(Body, tag_field="type", tag="video_url"):
    """A video input, vLLM's part (omni models only: another model refuses it naming the part)."""

    video_url: VideoUrl


ContentPart = TextPart | ImageUrlPart | InputAudioPart | VideoUrlPart


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON object as text (OpenAI's shape), or the object


class HistoryToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant message of the history (other keys are ignored)."""

    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessageParam(Body):
    """One message. `content` may be null only for an assistant; `tool_calls` only on an
    assistant message; a `tool` message names the call it answers (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[ContentPart], Meta(description="a string or a list of content parts")] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    #: an assistant turn's thinking, as a reply gave it (vLLM takes both names); the template
    #: reads it (`reasoning_content`: Qwen3's; gpt-oss's as `thinking`)
    reasoning_content: str | None = None
    reasoning: str | None = None


Messages = Annotated[list[ChatMessageParam], Meta(min_length=1, description="a non-empty list of message objects")]


class FunctionDefinition(Body):
    name: Annotated[str, Meta(pattern=f"^{NAME_RE.pattern}{END}",
                              description="1-64 characters of [A-Za-z0-9_.-]")]
    description: str | None = None
    parameters: Annotated[dict[str, Any], Meta(description="a JSON schema object")] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: Annotated[FunctionDefinition, Meta(description='an object {"name", "description", "parameters"}')]


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: Annotated[ToolChoiceFunction, Meta(description='an object {"name": ...}')]


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, Meta(
    description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]


class ChatCompletionRequest(OpenAIFields, kw_only=True):
    """`POST /v1/chat/completions`: `messages` rendered by the model's chat template."""

    messages: Messages
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    n: N | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Annotated[ToolDefinition, Meta(
        description='{"type": "function", "function": {"name", "parameters"}}')]],
        Meta(max_length=MAX_TOOLS, extra={"noun": "tools"})] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: reaches the chat template as `reasoning_effort` (gpt-oss's reads it; others ignore it)
    reasoning_effort: Annotated[Literal["low", "medium", "high"], Meta(description='"low", "medium" or "high"')] \
        | None = None


class TranscriptionForm(Body):
    """`POST /v1/audio/transcriptions` (multipart/form-data with the `file` part): OpenAI's
    fields, and mstar's `max_tokens`, `ignore_eos`, `seed`."""

    takes_unsupported: ClassVar[bool] = True
    model: str | None = None
    language: Language | None = None
    prompt: Annotated[None, Meta(description="left out or empty (no conditioning on previous text)")] = None
    response_format: Annotated[Literal["json", "text", "verbose_json"], Meta(
        description="one of json, text, verbose_json (no timestamps: not srt, vtt or diarized_json)")] | None = None
    temperature: Temperature | None = None
    stream: bool | None = None
    max_tokens: MaxTokens | None = None
    ignore_eos: bool | None = None
    seed: Seed | None = None


# ---- vLLM's /tokenize and /detokenize ---------------------------------------------------------


class TokenizeCompletionRequest(Body):
    """`POST /tokenize` with a prompt (special tokens added unless `add_special_tokens` is false)."""

    prompt: Annotated[str, Meta(description="a string (or give messages)")]
    model: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeChatRequest(Body):
    """`POST /tokenize` with messages: the chat prompt as `/v1/chat/completions` renders it."""

    messages: Messages
    model: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Body):
    """`POST /detokenize`: ids of the model's vocabulary (checked against it at run time)."""

    tokens: Annotated[list[int], Meta(description="a list of token ids")]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ModelCard(msgspec.Struct):
    """OpenAI's model object plus vLLM's `max_model_len`, what the model takes and gives
    (`input_modalities`, `output_modalities`: "text", "image", "audio", "embedding"; a
    robot policy's "state" in and "actions" out), and a
    vision model's `image_placeholder` (what a `/generate` prompt holds per image)."""

    id: str
    created: int
    max_model_len: int
    input_modalities: list[str]
    output_modalities: list[str]
    object: str = "model"
    owned_by: str = "mstar"
    image_placeholder: str | None = None
    audio_placeholder: str | None = None
    video_placeholder: str | None = None
    #: the sampling defaults in force where a request leaves a field out (the checkpoint's
    #: generation_config.json, `--generation-config`), `max_tokens` among them; null: none
    default_sampling: dict[str, float | int] | None = None
    #: the model's parameters (a mixture of experts: every expert's) and those one token
    #: computes with (its top-k experts'); null where the family does not count them
    parameters: int | None = None
    active_parameters: int | None = None
    #: what the model serves ("generate", "embed", "score", "speech", "act", "rollout"):
    #: the routes it answers (several models behind one server differ in it)
    task: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class VersionResponse(msgspec.Struct):
    version: str


class ErrorObject(msgspec.Struct):
    message: str
    type: str
    param: str | None
    error_id: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every error (DESIGN.md section 7): `param` names the offending field."""

    error: ErrorObject


# ---- fields this engine does not honour ------------------------------------------------------

#: name -> (the neutral values besides null, the 400's message). A route whose Struct does
#: not declare the name accepts it only with one of those values; a route that honours it
#: declares it (the completions route declares `echo`, chat `tools`, ...).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "n > 1 is not supported; n must be 1"),
    "best_of": ((1,), "best_of > 1 is not supported; best_of must be 1"),
    "logprobs": ((False,), "logprobs is not supported"),
    "top_logprobs": ((0,), "top_logprobs is not supported"),
    "prompt_logprobs": ((), "prompt_logprobs is not supported"),
    "tools": (([],), "tools is not supported"),
    "tool_choice": (("none",), "tool_choice is not supported"),
    "functions": (([],), "functions is not supported"),
    "function_call": (("none",), "function_call is not supported"),
    "parallel_tool_calls": ((), "parallel_tool_calls is not supported (no tools)"),
    "echo": ((False,), "echo is not supported"),
    "response_format": (({"type": "text"},), 'response_format is not supported; only {"type": "text"}'),
    "suffix": (("",), "suffix is not supported"),
    "stream_options": ((), "stream_options is only supported on the /v1 routes"),
    "modalities": ((["text"],), 'modalities is not supported; only ["text"]'),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "prediction (predicted outputs) is not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "web_search_options": ((), "web_search_options is not supported"),
}


def is_neutral(name: str, value: Any) -> bool:
    """`value` asks nothing of the unsupported field `name` (null, or a neutral value of the
    same JSON type: `n: 1` is, `n: true` is not)."""
    return value is None or any(type(value) is type(n) and value == n for n in UNSUPPORTED[name][0])


# ---- pooling routes: /v1/embeddings, /v1/score, /v1/rerank ----------------------------------

#: inputs of one pooling request (OpenAI's limit on an embeddings call)
MAX_INPUTS = 2048


class EmbeddingRequest(Body):
    """The body of `POST /v1/embeddings`."""

    input: Annotated[str | list[str | Annotated[int, Meta(ge=0, le=INT32_MAX)] | list[int]],
                     Meta(description="a string, a list of strings, a list of token ids, or a list of lists of "
                                      "token ids")]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, le=INT32_MAX, description="an integer >= 1")] | None = None
    user: str | None = None
    #: vLLM's: cut each input to this many tokens (-1: the model's max length) instead of a 400
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=INT32_MAX,
                                                description="an integer >= 1, or -1 for the model's max length")
                                      ] | None = None
    add_special_tokens: bool = True


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
    created: int = 0


Cut = Annotated[int, Meta(ge=-1, le=INT32_MAX, description="an integer >= 1, or -1 for the model's max length")]


class ScoreRequest(Body):
    """The body of `POST /v1/score`: text_1 against each text_2 (one against many), or
    pairwise when both are lists of one length."""

    text_1: Annotated[str | list[str], Meta(description="a string or a list of strings")]
    text_2: Annotated[str | list[str], Meta(description="a string or a list of strings")]
    model: str | None = None
    truncate_prompt_tokens: Cut | None = None
    user: str | None = None


class RerankRequest(Body):
    """The body of `POST /v1/rerank`: the documents ordered by relevance to the query."""

    query: str
    documents: list[str]
    model: str | None = None
    #: the best this many (None or 0: all)
    top_n: Annotated[int, Meta(ge=0, le=INT32_MAX, description="an integer >= 0 (0: all)")] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: Cut | None = None
    user: str | None = None


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(msgspec.Struct):
    id: str
    data: list[ScoreData]
    model: str
    usage: ScoreUsage
    object: str = "list"
    created: int = 0


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# ---- the routes and their document -----------------------------------------------------------


class SpeechRequest(Body):
    """`POST /v1/audio/speech`."""

    input: Annotated[str, Meta(min_length=1, max_length=4096, description="the text to speak")]
    model: str | None = None
    voice: Annotated[str, Meta(min_length=1, description="one of the model's voices (/v1/models)")] | None = None
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus", "aac"] | None = None
    stream_format: Literal["audio", "sse"] | None = None
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] | None = None
    instructions: str | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None
    max_audio_seconds: Annotated[float, Meta(gt=0.0, le=86400.0, description=(
        "the most sound to make, in seconds (rounded up to whole frames; with max_tokens, the smaller cap); "
        "past what the model's frame loop allows it is refused as max_tokens is"))] | None = None
    context: Context | None = None
    exaggeration: Annotated[float, Meta(description=(
        "Chatterbox: the emotion exaggeration of its voice (0 to 2; the package's 0.5 when absent)"))] | None = None
    cfg_weight: Annotated[float, Meta(description=(
        "Chatterbox: the classifier-free guidance weight (0 to 2; the package's 0.5 when absent)"))] | None = None
    non_streaming_mode: Annotated[bool, Meta(description=(
        "Qwen3-TTS: false feeds the text one token a frame (the package's streaming text); true or absent puts "
        "it all in the prompt (its non-streaming mode)"))] | None = None


class Route(NamedTuple):
    """A route's declared shapes: its JSON body, its multipart/form-data fields (the `file`
    part besides them), its 200 reply where one Struct says it."""

    body: type[Body] | tuple[type[Body], ...] | None = None  # a tuple: one of them
    response: type[msgspec.Struct] | None = None
    form: type[Body] | None = None


# ---- /v1/actions (robot policies) ---------------------------------------------------------


class Observation(Body):
    """A robot's observation: each camera's image (a data URL) by name, its state."""

    images: dict[str, Annotated[str, Meta(min_length=1)]]
    state: list[float]


class ActionRequest(Body):
    """The body of `POST /v1/actions`."""

    observation: Observation
    model: str | None = None
    prompt: str = ""
    noise: list[list[float]] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1, description="an integer >= 0")] | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None


class ActionUsage(msgspec.Struct):
    """The prefix's rows (image rows and prompt tokens); no tokens are generated."""

    prompt_tokens: int
    total_tokens: int


class ActionResponse(msgspec.Struct):
    """The reply of `POST /v1/actions`: chunk x action_dim actions."""

    id: str
    model: str
    actions: list[list[float]]
    usage: ActionUsage
    object: str = "actions"


# ---- /v1/world/rollout (world models) -----------------------------------------------------


class RolloutRequest(Body):
    """The body of `POST /v1/world/rollout`: a context clip (data URLs), actions and states
    (frames + steps - 1 rows each), the steps to predict."""

    frames: list[Annotated[str, Meta(min_length=1)]]
    actions: list[list[float]]
    states: list[list[float]]
    steps: Annotated[int, Meta(ge=1, description="an integer >= 1")]
    model: str | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None


class RolloutItem(msgspec.Struct):
    """One predicted step: its tokens x embed_dim float32 embedding, base64 little-endian."""

    index: int
    shape: list[int]
    embedding: str
    object: str = "embedding"


class RolloutResponse(msgspec.Struct):
    """The reply of `POST /v1/world/rollout`: one item per predicted step."""

    data: list[RolloutItem]
    model: str
    object: str = "list"
