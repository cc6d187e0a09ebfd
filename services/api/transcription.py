"""Speech models at the api: is the served model one, and the replies of
`/v1/audio/transcriptions` (`json`, `text`, `verbose_json`, and the SSE stream).

The api never decodes audio: the data worker does (its refusals come back as 400s with
param "file"). The one thing read here is the file's header, for `verbose_json`'s
`duration`, and only once the request has succeeded.

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

import msgspec
from starlette.responses import Response

from services.api.errors import ApiError
from services.api.events import DeltaEvent, DoneEvent, encode
from services.api.openai_format import error_chunk
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
        return error_chunk(err)

    def end(self) -> bytes:
        return b""
