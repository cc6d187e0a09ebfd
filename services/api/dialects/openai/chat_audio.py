"""Speech out on `/v1/chat/completions` (an omni model with a talker: Qwen3-Omni), as
OpenAI's chat with audio: `modalities: ["text", "audio"]` and `audio: {"voice", "format"}`.

- the reply's `message.content` is the text and `message.audio` is `{"id", "data": the
  whole clip as a base64 file in `format` ("wav", or "pcm16": raw 16-bit little-endian,
  24 kHz mono), "expires_at", "transcript": the text}`;
- streamed: `delta.content` chunks (the text), then `delta.audio` chunks `{"id", "data":
  base64 pcm16}` whose bytes join to the whole clip.
Refused with a 400 naming the field: `modalities` that is not a list of "text" and "audio",
or "audio" without "text" (OpenAI asks for both); `audio` missing when audio is asked (or
sent without it), not an object, or with other keys; `audio.voice` the model lacks;
`audio.format` other than wav or pcm16. A model without a talker refuses "audio".
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.api.errors import invalid
from services.api.speech import wav_header
from shared.audio import to_pcm16
from shared.deferred import deferred

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

FORMATS = ("wav", "pcm16")
#: how long OpenAI's reply says a clip is kept (this server keeps none: the field is its shape)
EXPIRES_S = 3600


@dataclass(frozen=True)
class SpeechOut:
    voice: str
    format: str
    rate: int


def speech_out(obj: dict[str, Any], voices: tuple[str, ...], rate: int, model: str) -> SpeechOut | None:
    """The request's speech options, or None for text only; `modalities` and `audio` are
    taken out of `obj` (the chat body's parser refuses them otherwise)."""
    modalities, audio = obj.pop("modalities", None), obj.pop("audio", None)
    if modalities is not None and (not isinstance(modalities, list)
                                   or any(m not in ("text", "audio") for m in modalities) or not modalities):
        raise invalid("modalities", 'modalities must be a list of "text" and "audio"')
    if modalities is None or "audio" not in modalities:
        if audio is not None:
            raise invalid("audio", 'audio output options need modalities ["text", "audio"]')
        return None
    if "text" not in modalities:
        raise invalid("modalities", 'modalities must include "text" with "audio" (the reply is text and its speech)')
    if not voices:
        raise invalid("modalities", f"{model!r} writes text only (it has no talker): send modalities [\"text\"]")
    if audio is None:
        raise invalid("audio", 'modalities with "audio" needs audio: {"voice", "format"}')
    if not isinstance(audio, dict) or set(audio) - {"voice", "format"}:
        raise invalid("audio", 'audio must be an object {"voice", "format"}')
    voice, fmt = audio.get("voice"), audio.get("format", "wav")
    if not isinstance(voice, str) or voice.lower() not in voices:
        raise invalid("audio.voice", f"voice {voice!r} is not one of {model!r}'s voices {list(voices)}")
    if fmt not in FORMATS:
        raise invalid("audio.format", f"audio.format must be one of {list(FORMATS)}")
    return SpeechOut(voice.lower(), fmt, rate)


def audio_message(speech: SpeechOut, request_id: str, samples: bytes, transcript: str | None) -> dict[str, Any]:
    """`message.audio` of a whole reply: the clip as a base64 file."""
    pcm = to_pcm16(np.frombuffer(samples, dtype="<f4"))
    data = wav_file(pcm, speech.rate) if speech.format == "wav" else pcm
    return {"id": f"audio_{request_id}", "data": base64.b64encode(data).decode(),
            "expires_at": int(time.time()) + EXPIRES_S, "transcript": transcript or ""}


def audio_delta(request_id: str, samples: bytes) -> dict[str, Any]:
    """`delta.audio` of a streamed chunk: its samples as base64 pcm16."""
    return {"id": f"audio_{request_id}", "data": base64.b64encode(to_pcm16(np.frombuffer(samples, "<f4"))).decode()}


def wav_file(pcm: bytes, rate: int) -> bytes:
    return wav_header(rate, len(pcm)) + pcm
