"""`POST /v1/audio/speech` (OpenAI's text-to-speech route) for a model whose task is
"speech" (Orpheus): the body, and the replies in each format.

- `response_format`: `wav` (16-bit PCM), `pcm` (raw 16-bit signed little-endian, mono, at
  the model's rate: 24 kHz for SNAC and Mimi, as OpenAI's pcm), `flac`, `mp3` (MPEG-2
  layer III) and `opus` (in Ogg), the last three through libsndfile (soundfile); `aac` is
  refused by name (no encoder here). A body without one gets wav (OpenAI's default is
  mp3; wav keeps a client that never asked for a lossy format exact).
- `stream_format`: absent: the whole clip as one body; `audio`: the audio bytes as the
  codec makes them (`pcm`, or `wav` whose header's sizes say "unknown", as OpenAI's
  streamed wav does; `flac`, `mp3` and `opus` are refused: their encoders want the whole
  clip); `sse`: OpenAI's events
  `{"type": "speech.audio.delta", "audio": base64 pcm16}` ... then `{"type":
  "speech.audio.done", "usage": {input_tokens, output_tokens, total_tokens}}`.
- `speed` other than 1.0 is refused, and `instructions` unless the model takes them
  (Qwen3-TTS: a user turn before the text);
  `voice` must be one of the model's (the data worker's 400 names it).
- `context` (CSM's voice continuation, an extension): the conversation's earlier turns,
  oldest first, each `{"speaker", "text", "audio"}` (audio: a base64 WAV or FLAC file, or
  absent); the model hears them and speaks `input` as the next turn.
- A family's own fields (`exaggeration`, `cfg_weight`: Chatterbox's; `non_streaming_mode`:
  Qwen3-TTS') are refused (400
  naming the field and the family that reads it) for a model of another family, which
  would otherwise ignore them without a word.
- Sampling: the model's own defaults (`ModelSpec.speech_defaults`: Orpheus' temperature
  0.6, top_p 0.8, repetition_penalty 1.3; CSM's temperature 0.9, top_k 50), which a body
  may set (vLLM-style extra fields), with `seed` and `max_tokens` (Orpheus: audio tokens,
  7 a frame, 12 frames ~ a second; CSM: frames, 12.5 a second), or the length in seconds
  (`max_audio_seconds`, an extension: whole frames, rounded up; the smaller cap if both).

The audio rides on the outputs as float32 samples (`Output.audio`, made by the gpu
worker's codec); this module only encodes them (soundfile, numpy).
"""

from __future__ import annotations

import base64
import io
import math
import struct
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api.chat_request import check_model
from services.api.errors import ApiError, invalid
from services.api.events import DeltaEvent, DoneEvent, error_event, sse_chunk
from services.api.schemas import SpeechRequest
from services.api.serving import Prepared, serve
from services.api.settings import ApiSettings
from services.api.state import ApiState, task_refusal
from services.api.streaming import EventStream
from services.api.validation import GenerateParams, context_turns, load, new_request_id
from shared.audio import to_pcm16
from shared.deferred import deferred
from shared.frames import SamplingParams

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/opus"}
REFUSED_FORMATS = ("aac",)
#: the per-family extension fields of `SpeechRequest`, each with the family that reads it
#: (a served family's `ModelSpec.speech_extensions` says which it takes)
EXTENSION_FAMILIES = {"exaggeration": "Chatterbox", "cfg_weight": "Chatterbox", "non_streaming_mode": "Qwen3-TTS"}
#: soundfile's (format, subtype) of each format it encodes
SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


def check_speech(req: SpeechRequest, instructions: bool = False) -> str:
    """The response format, after the fields the model cannot honour are refused."""
    fmt = req.response_format or "wav"
    if fmt in REFUSED_FORMATS:
        raise invalid("response_format", f"response_format {fmt!r} is not offered; use one of {', '.join(FORMATS)}")
    if req.speed is not None and req.speed != 1.0:
        raise invalid("speed", f"speed {req.speed} is not supported: the model speaks at its own pace (1.0)")
    if req.instructions and not instructions:
        raise invalid("instructions", "instructions are not supported by this model")
    if req.stream_format == "audio" and fmt in SOUNDFILE:
        raise invalid("stream_format", f"{fmt} cannot be streamed as it is made; use pcm or wav, or stream_format sse")
    return fmt


def extension_options(req: SpeechRequest, settings: ApiSettings) -> dict[str, float | bool]:
    """The body's family extension fields, as options (the family's spec checks their
    values); one the served family does not read is refused, naming the family that does,
    rather than silently ignored."""
    out: dict[str, float | bool] = {}
    for name, family in EXTENSION_FAMILIES.items():
        value = getattr(req, name)
        if value is None:
            continue
        if name not in settings.speech_extensions:
            raise invalid(name, f"{name} is a {family} extension; the served model ({settings.model_name}) "
                                f"does not use it")
        out[name] = value
    return out


def model_defaults(settings: ApiSettings) -> dict[str, float]:
    """The model family's speech defaults, under the checkpoint's generation_config.json."""
    return {**settings.speech_defaults, **settings.generation_defaults.sampling()}


def sampling_fields(req: SpeechRequest, defaults: dict[str, float]) -> dict[str, Any]:
    """The sampling settings: the body's, else the model's own defaults."""
    given = {k: getattr(req, k) for k in ("temperature", "top_p", "repetition_penalty", "seed")}
    kept = {k: int(v) if k == "top_k" else v for k, v in defaults.items()}
    return {**kept, **{k: v for k, v in given.items() if v is not None}}



def floats(audio: bytes) -> np.ndarray:
    return np.frombuffer(audio, dtype="<f4")


def wav_header(rate: int, data_bytes: int = 0xFFFFFFFF - 36) -> bytes:
    """A 16-bit mono PCM WAV header; the default sizes say "unknown length" (a stream)."""
    return (b"RIFF" + struct.pack("<I", min(0xFFFFFFFF, data_bytes + 36)) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def encode_audio(samples: np.ndarray, fmt: str, rate: int) -> bytes:
    """A whole clip in `fmt`: wav and pcm are 16-bit PCM, flac, mp3 and opus through soundfile."""
    if fmt == "pcm":
        return to_pcm16(samples)
    if fmt == "wav":
        data = to_pcm16(samples)
        return wav_header(rate, len(data)) + data
    import soundfile

    buf = io.BytesIO()  # the same 16-bit samples as wav and pcm (soundfile's own float rounding differs)
    kind, subtype = SOUNDFILE[fmt]
    soundfile.write(buf, np.frombuffer(to_pcm16(samples), "<i2"), rate, format=kind, subtype=subtype)
    return buf.getvalue()


class AudioDelta(msgspec.Struct, tag_field="type", tag="speech.audio.delta"):
    audio: str


class SpeechUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class AudioDone(msgspec.Struct, tag_field="type", tag="speech.audio.done"):
    usage: SpeechUsage


class SpeechReply:
    """The route's answer: the whole clip, raw audio chunks, or OpenAI's SSE events."""

    def __init__(self, client_id: str, fmt: str, stream_format: str | None, rate: int) -> None:
        self.client_id, self.fmt, self.stream_format, self.rate = client_id, fmt, stream_format, rate
        self._started = False
        sse = stream_format == "sse"
        media = "text/event-stream; charset=utf-8" if sse else FORMATS[fmt]
        self.headers = [(b"content-type", media.encode()), (b"cache-control", b"no-cache")]

    def json(self, done: DoneEvent) -> Response:
        body = encode_audio(floats(done.audio or b""), self.fmt, self.rate)
        return Response(body, media_type=FORMATS[self.fmt])

    def event(self, event: DeltaEvent | DoneEvent) -> bytes:
        if self.stream_format == "sse":
            if isinstance(event, DoneEvent):
                u = event.usage
                return sse_chunk(AudioDone(SpeechUsage(u.prompt_tokens, u.completion_tokens,
                                                       u.prompt_tokens + u.completion_tokens)))
            audio = event.audio or b""
            return sse_chunk(AudioDelta(base64.b64encode(to_pcm16(floats(audio))).decode())) if audio else b""
        if isinstance(event, DoneEvent):
            return b""
        head = b""
        if not self._started and self.fmt == "wav":
            head = wav_header(self.rate)
        self._started = True
        return head + to_pcm16(floats(event.audio or b""))

    def error(self, err: ApiError) -> bytes:
        # raw audio has no way to say it; the stream just ends (the log has the error)
        return sse_chunk(error_event(self.client_id, err)) if self.stream_format == "sse" else b""

    def end(self) -> bytes:
        return b""


def _accept_speech(obj: dict[str, Any], state: ApiState) -> Prepared:
    settings = state.settings
    if settings.task != "speech":
        raise invalid("model", task_refusal(settings.model_name, settings.task, "speech"))
    req = load(obj, SpeechRequest)
    check_model(req.model, settings.model_name)
    fmt = check_speech(req, settings.speech_instructions)
    options: dict[str, int | str | float | bool] = {} if req.voice is None else {"voice": req.voice}
    options.update(extension_options(req, settings))
    if req.instructions:
        options["instructions"] = req.instructions
    params = GenerateParams(request_id=f"speech-{new_request_id()[4:]}",
                            sampling=SamplingParams(**sampling_fields(req, model_defaults(settings))),
                            max_tokens=token_cap(req, settings.audio_frame_rate, settings.audio_frame_tokens,
                                                 settings.audio_extra_tokens),
                            prompt=req.input, options=options, context=context_turns(req.context),
                            defaulted=frozenset())  # its sampling is filled above; max_tokens' default applies
    reply = SpeechReply(params.request_id, fmt, req.stream_format, settings.sample_rate)
    return Prepared(params, req.stream_format is not None, reply, task="speech")


def token_cap(req: SpeechRequest, frame_rate: float, frame_tokens: int, extra: int = 0) -> int | None:
    """The request's cap in output tokens: `max_tokens`, or `max_audio_seconds` of sound in
    whole frames (Orpheus: 7 tokens a frame; CSM: 1) plus the tokens a clip takes beyond
    its frames' (`extra`: Higgs' 8 delay frames), the smaller where both are given."""
    if req.max_audio_seconds is None:
        return req.max_tokens
    if frame_rate <= 0:  # (a speech model always says its rate)
        raise invalid("max_audio_seconds", "the served model does not say its frame rate")
    tokens = max(1, math.ceil(req.max_audio_seconds * frame_rate - 1e-9)) * frame_tokens + extra
    return tokens if req.max_tokens is None else min(tokens, req.max_tokens)


async def speech(request: Request) -> Response | EventStream:
    """POST /v1/audio/speech."""
    return await serve(request, _accept_speech, "/v1/audio/speech")
