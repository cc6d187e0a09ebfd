"""Speech models at the api: is the served model one, and `POST /v1/audio/transcriptions`
(OpenAI's speech-to-text route, multipart/form-data): its form's checks, the route, and its
replies (`json`, `text`, `verbose_json`, and the SSE stream). One module per task route, as
`speech.py`, `embeddings.py` and `scoring.py`: it reads its form with the core
(`schemas.TranscriptionForm`, `validation.py`, `chat_request.check_model`) and imports no
dialect.

The api never decodes audio: the data worker does (its refusals come back as 400s with
param "file"). The one thing read here is the file's header, for `verbose_json`'s
`duration`, and only once the request has succeeded.

Form (OpenAI's): `temperature` defaults to 0 (greedy; OpenAI's default too), `prompt`
(previous-text conditioning) is refused unless empty, `response_format` is `json`, `text`
or `verbose_json`, and `stream` works with `json` / `text` only.

Shapes (OpenAI's, kept simple):
- `json`: `{"text"}`;
- `text`: the text as a text/plain body;
- `verbose_json`: `{"task": "transcribe", "language", "duration", "text", "segments"}` with
  one segment `{"id": 0, "seek": 0, "start": 0.0, "end": duration, "text", "tokens",
  "temperature"}` (no timestamps are decoded, so the whole clip is one segment; `tokens`
  are every id the decoder generated after its forced prompt, the end-of-text id included
  when the model stopped on it; `language` is the one the worker reports it decoded in
  (the detected one when none was sent and the model has no default), else the code
  sent, else the model's default;
  OpenAI's `avg_logprob` / `compression_ratio` / `no_speech_prob` are left out);
- stream: `data: {"type": "transcript.text.delta", "delta"}` events (none with an empty
  delta), then `data: {"type": "transcript.text.done", "text"}`, whose text is the deltas
  joined; a failure after the first event is `data: {"error": {...}}`. No `[DONE]` line:
  the done event ends the stream, as OpenAI's does.
"""

from __future__ import annotations

import io
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api.chat_request import check_model
from services.api.errors import ApiError, invalid
from services.api.events import DeltaEvent, DoneEvent, encode
from services.api.forms import Form, parse_form
from services.api.schemas import TranscriptionForm
from services.api.serving import Prepared, serve
from services.api.state import ApiState
from services.api.streaming import EventStream
from services.api.validation import GenerateParams, check_audio, load, sampling_params
from shared.errors import ErrorKind

log = logging.getLogger("mstar.api")

TEXT_PLAIN = "text/plain; charset=utf-8"


NOT_SPEECH = "the served model does not take audio"


def require_speech_model(takes_audio: bool) -> None:
    """The audio routes' first check: 400 (param "file") when the model is not a speech one."""
    if not takes_audio:
        raise ApiError(ErrorKind.INVALID, NOT_SPEECH, "file")


def is_speech_model(config: dict) -> bool:
    """A Whisper checkpoint (architectures or model_type), the only speech family."""
    archs = config.get("architectures") or []
    return config.get("model_type") == "whisper" or any(str(a).startswith("Whisper") for a in archs)


def default_language(source) -> str | None:
    """The language code the served speech model assumes when a request names none (what
    its forced decoder prompt holds), or None when it cannot be told or the model detects
    it (the worker then reports the one it detected)."""
    try:
        spec = source.spec(page_size=16)
        if not getattr(spec, "lang_to_id", None):
            return "en"  # an English-only checkpoint
        if spec.detects_language(None):
            return None
        by_id = {i: token for token, i in spec.lang_to_id.items()}
        token = next((by_id[i] for i in spec.forced_ids() if i in by_id), None)
        return None if token is None else language_code(token)
    except Exception:  # the data worker reports a broken folder; the api only loses the label
        log.warning("cannot tell the default language of %s", getattr(source, "path", source), exc_info=True)
        return None


def language_code(language: str) -> str:
    """"<|en|>" or "EN" -> "en"."""
    if language.startswith("<|") and language.endswith("|>"):
        language = language[2:-2]
    return language.lower()


def audio_duration(audio: bytes) -> float | None:
    """Seconds of audio in the file, from its header (None if it cannot be read)."""
    import soundfile as sf  # lazy: only verbose_json needs it

    try:
        with sf.SoundFile(io.BytesIO(audio)) as f:
            return f.frames / f.samplerate if f.samplerate else None
    except Exception:
        return None


class TextDelta(msgspec.Struct, tag_field="type", tag="transcript.text.delta"):
    delta: str


class TextDone(msgspec.Struct, tag_field="type", tag="transcript.text.done"):
    text: str


class TranscriptionReply:
    """Answers one `/v1/audio/transcriptions` request (see the module docstring)."""

    def __init__(self, response_format: str, audio: bytes, language: str | None, temperature: float) -> None:
        self.response_format = response_format
        self._audio = audio if response_format == "verbose_json" else b""  # only for its duration
        self.language = language
        self.temperature = temperature

    def json(self, done: DoneEvent) -> dict | Response:
        if self.response_format == "text":
            return Response(done.text, media_type=TEXT_PLAIN)
        if self.response_format == "json":
            return {"text": done.text}
        duration = audio_duration(self._audio)
        segment = {"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": done.text,
                   "tokens": done.token_ids, "temperature": self.temperature}
        reported = done.metadata.get("language") if isinstance(done.metadata, dict) else None
        return {"task": "transcribe", "language": reported or self.language, "duration": duration,
                "text": done.text, "segments": [segment]}

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        if type(event) is DeltaEvent:
            return b"data: " + encode(TextDelta(event.text)) + b"\n\n" if event.text else b""
        return b"data: " + encode(TextDone(event.text)) + b"\n\n"

    def error(self, err: ApiError) -> bytes:
        return b"data: " + encode(err.body()) + b"\n\n"  # OpenAI's SSE error, as on chat

    def end(self) -> bytes:
        return b""


class TranscriptionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A validated `/v1/audio/transcriptions` form."""

    params: GenerateParams
    response_format: str = "json"
    stream: bool = False


def transcription_id() -> str:
    return f"trsc-{uuid.uuid4().hex}"


def parse_transcription(obj: Mapping[str, Any], audio: bytes | None, served: str) -> TranscriptionRequest:
    """Validate the fields of a `/v1/audio/transcriptions` form (typed by `forms.py`;
    `schemas.TranscriptionForm`)."""
    req = load(obj, TranscriptionForm)
    check_model(req.model, served)
    audio = check_audio(audio)
    response_format = req.response_format or "json"
    stream = bool(req.stream)
    if stream and response_format == "verbose_json":
        raise invalid("stream", "stream is not supported with response_format verbose_json; use json or text")
    if req.temperature is None:  # greedy unless asked otherwise (OpenAI's default is 0 too)
        req = msgspec.structs.replace(req, temperature=0.0)
    params = GenerateParams(
        request_id=transcription_id(),
        sampling=sampling_params(req),
        max_tokens=req.max_tokens,
        stream=stream,
        audio=audio,
        language=req.language,
        task="transcribe",
    )
    return TranscriptionRequest(params=params, response_format=response_format, stream=stream)


def _accept_transcription(form: Form, state: ApiState) -> Prepared:
    settings = state.settings
    require_speech_model(settings.takes_audio)
    req = parse_transcription(form.fields, form.file, settings.model_name)
    params = req.params
    language = language_code(params.language) if params.language else settings.audio_language
    reply = TranscriptionReply(req.response_format, params.audio or b"", language, params.sampling.temperature)
    return Prepared(params, req.stream, reply)


async def transcriptions(request: Request) -> Response | EventStream:
    """POST /v1/audio/transcriptions (multipart/form-data)."""
    return await serve(request, _accept_transcription, "/v1/audio/transcriptions", decode=parse_form)
