"""Audio inputs of an omni model: an `input_audio` part's (or `/generate`'s `audios[i]`)
base64 file, decoded and checked here, so audio that is not audio is the client's 400 with
`param` naming the field (`messages[0].content[1].input_audio.data`) rather than a failure in
the data worker.

Checked: the base64 (a bare string, or a `data:audio/...;base64,` URL), the size
(`MAX_AUDIO_BYTES`, from the base64 length before decoding), and the header libsndfile reads
(a WAV, FLAC, MP3 or OGG container with samples). The data worker decodes the samples, makes
the features and refuses a clip too short or too long (`shared.specs.qwen3_omni`).
"""

from __future__ import annotations

import io

from services.api.base64_input import decode_capped
from services.api.errors import invalid

#: 25 MiB, OpenAI's limit for an audio file
MAX_AUDIO_BYTES = 25 << 20
#: the containers the data worker decodes (libsndfile's names)
CONTAINERS = frozenset({"WAV", "WAVEX", "RF64", "FLAC", "MP3", "OGG"})


def decode_audio_input(data: str, param: str) -> bytes:
    """The file `data` carries (base64, or a base64 data URL), checked; else a 400 on `param`."""
    if data.startswith("data:"):
        header, sep, data = data[5:].partition(",")
        if not sep or "base64" not in header.lower().split(";")[1:]:
            raise invalid(param, "a data URL must be data:audio/<type>;base64,<base64 data>")
    raw = decode_capped(data, MAX_AUDIO_BYTES, param, "audio")
    check_audio(raw, param)
    return raw


def check_audio(raw: bytes, param: str) -> None:
    """A 400 on `param` unless libsndfile reads `raw`'s header as a container it decodes,
    with at least one sample."""
    import soundfile as sf

    if not raw:
        raise invalid(param, f"{param} is empty; send a WAV, FLAC, MP3 or OGG file")
    try:
        info = sf.info(io.BytesIO(raw))
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise invalid(param, f"{param} is not audio this server decodes; send a WAV, FLAC, MP3 or OGG file") from exc
    if info.format not in CONTAINERS:
        raise invalid(param, f"{param} is a {info.format} file; send a WAV, FLAC, MP3 or OGG file")
    if info.frames <= 0:
        raise invalid(param, f"{param} has no samples")
