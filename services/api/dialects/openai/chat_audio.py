"""Speech out on `/v1/chat/completions` (an omni model with a talker: Qwen3-Omni), as
OpenAI's chat with audio: `modalities: ["text", "audio"]` and `audio: {"voice", "format"}`.

- the reply's `message.content` is the text and `message.audio` is `{"id", "data": the
  whole clip as a base64 file in `format` ("wav", or "pcm16": raw 16-bit little-endian,
  24 kHz mono), "expires_at", "transcript": the text}`;
- streamed: `delta.content` chunks (the text), then `delta.audio` chunks `{"id", "data":
  base64 pcm16}` whose bytes join to the whole clip.
An extension: `audio.temperature` (>= 0; 0 is greedy), `audio.top_p` (0 < p <= 1) and
`audio.top_k` (an int; 0 or -1 is off) sample the talker's codes (the thinker's text
follows the request's own fields); what is left out takes transformers' talker defaults
(services/gpu_worker/runners/omni_talker_sampling.py), except that a request whose own
temperature is 0 speaks greedily too. The request's `seed` seeds both.
Refused with a 400 naming the field: `modalities` that is not a list of "text" and "audio",
or "audio" without "text" (OpenAI asks for both); `audio` missing when audio is asked (or
sent without it), not an object, or with other keys; `audio.voice` the model lacks;
`audio.format` other than wav or pcm16; a talker sampling field of the wrong type or out of
its range. A model without a talker refuses "audio".
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
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


#: the talker's sampling fields in `audio`, each with its check and what it must be
TALKER_FIELDS = {"temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
                 "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
                 "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1, "an int >= -1")}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class SpeechOut:
    voice: str
    format: str
    rate: int
    #: the talker's sampling fields the request set ("temperature", "top_p", "top_k")
    talker: dict[str, float | int] = field(default_factory=dict)

    def options(self, greedy: bool) -> dict[str, float | int]:
        """The data worker's options for the talker ("talker_temperature"...): those set,
        and temperature 0 where the request is `greedy` and left the talker's out."""
        out = {f"talker_{k}": v for k, v in self.talker.items()}
        if greedy and "temperature" not in self.talker:
            out["talker_temperature"] = 0.0
        return out


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
    if not isinstance(audio, dict) or set(audio) - {"voice", "format", *TALKER_FIELDS}:
        raise invalid("audio", 'audio must be an object {"voice", "format"} (and the talker\'s "temperature", '
                               '"top_p", "top_k")')
    voice, fmt = audio.get("voice"), audio.get("format", "wav")
    if not isinstance(voice, str) or voice.lower() not in voices:
        raise invalid("audio.voice", f"voice {voice!r} is not one of {model!r}'s voices {list(voices)}")
    if fmt not in FORMATS:
        raise invalid("audio.format", f"audio.format must be one of {list(FORMATS)}")
    for name, (ok, what) in TALKER_FIELDS.items():
        if name in audio and not ok(audio[name]):
            raise invalid(f"audio.{name}", f"audio.{name} must be {what}")
    return SpeechOut(voice.lower(), fmt, rate, {k: audio[k] for k in TALKER_FIELDS if k in audio})


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
