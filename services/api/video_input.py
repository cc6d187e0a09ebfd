"""Video inputs of an omni model: a `video_url` part's (or `/generate`'s `videos[i]`) data
URL, decoded and checked here, so a video that is not a video, or one over the limits, is
the client's 400 with `param` naming the field (`messages[0].content[1].video_url.url`)
rather than a failure in the data worker.

Checked: the data URL (`data:video/<type>;base64,...`: this server fetches no video URLs),
the size (`MAX_VIDEO_BYTES`, from the base64 length before decoding), and the container
PyAV opens: a video stream whose frames are at most `MAX_FRAME_PIXELS` pixels, at most
`MAX_DECODED_FRAMES` frames, at least `MIN_FRAMES` where the stream declares its count, and
a first frame that decodes. The data worker decodes
every frame, samples and preprocesses them (`shared.specs.qwen3_omni_video`).
"""

from __future__ import annotations

import io

from services.api.base64_input import decode_capped
from services.api.errors import invalid

#: 64 MiB of video file a request part
MAX_VIDEO_BYTES = 64 << 20
#: video inputs a request
MAX_VIDEOS = 4
#: frames a video needs at least (a temporal patch of the Qwen vision towers)
MIN_FRAMES = 2


def decode_video_input(url: str, param: str) -> bytes:
    """The file a `data:video/...;base64,` URL carries, checked; else a 400 on `param`."""
    if not url.startswith("data:"):
        raise invalid(param, f"{param} must be a data URL (data:video/mp4;base64,...); video URLs are not fetched")
    header, sep, data = url[5:].partition(",")
    fields = header.lower().split(";")
    if not sep or "base64" not in fields[1:] or not fields[0].startswith("video/"):
        raise invalid(param, f"{param} must be data:video/<type>;base64,<base64 data>")
    raw = decode_capped(data, MAX_VIDEO_BYTES, param, "video")
    check_video(raw, param)
    return raw


def check_video(raw: bytes, param: str) -> None:
    """A 400 on `param` unless PyAV opens `raw` as a container with a video stream within
    the limits whose first frame decodes."""
    import av

    from shared.specs.qwen3_omni_video import MAX_FRAME_PIXELS  # Pillow's importers: not at the api's start
    from shared.vision.qwen_video import MAX_DECODED_FRAMES

    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.video:
                raise invalid(param, f"{param} has no video stream")
            stream = container.streams.video[0]
            pixels = stream.codec_context.width * stream.codec_context.height
            if pixels > MAX_FRAME_PIXELS:
                raise invalid(param, f"{param}'s frames are {pixels} pixels; the limit is {MAX_FRAME_PIXELS}")
            if stream.frames > MAX_DECODED_FRAMES:
                raise invalid(param, f"{param} has {stream.frames} frames; the limit is {MAX_DECODED_FRAMES}")
            if 0 < stream.frames < MIN_FRAMES:
                raise invalid(param, f"{param} has {stream.frames} frame(s); a video needs at least {MIN_FRAMES} "
                                     "(one temporal patch)")
            next(container.decode(stream))
    except (av.error.FFmpegError, StopIteration, UnicodeDecodeError) as exc:
        raise invalid(param, f"{param} is not a video this server decodes; send an MP4 (or WebM, MKV)") from exc
