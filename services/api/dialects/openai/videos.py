"""OpenAI's video job API for a text-to-video model (Cosmos 3): `POST /v1/videos` (JSON, or
multipart/form-data as the official client sends it) starts a job and answers it at once;
`GET /v1/videos/{id}` is the job; `DELETE /v1/videos/{id}` forgets it (aborting it while it runs);
`GET /v1/videos/{id}/content` its MP4 (H.264, PyAV), or
with `?variant=frames` the raw frames as a .npy uint8 array [F, H, W, 3] (the frames
diffusers' `numpy_to_pil` rounding makes: for exact checks).

Body: `prompt`, `size` ("WxH"), `seconds` (OpenAI's: frames = 24 x seconds + 1, at the
pipeline's 24 fps), `model`; extensions `num_frames` (over `seconds`), `seed`,
`num_inference_steps`, `guidance_scale`, `negative_prompt`. `input_reference` (image to
video) is refused: text to video only. A size, frame count or step count the model cannot
do is a 400 naming the field before any job exists; a job that fails later (the data
worker's or the worker's refusal) is `status: "failed"` with `error: {code, message}`.

Jobs live in the api process (`VideoJobs`): at most `MAX_JOBS`, each kept `TTL_S` seconds
after it ends (then 404); when every slot holds a running job a new one is a 429. The
job's `progress` is its denoising steps done over its steps, in percent: the worker runs
the loop one iteration a worker step and each sends the request's progress
(`Output.steps_done`), so it moves with the iterations; it is 100 only once the frames
have arrived.
"""

from __future__ import annotations

import asyncio
import io
import logging
import secrets
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from services.api.dialects.openai.images import (
    PixelFields,
    check_frames,
    check_served,
    engine_options,
    frames_of,
    npy,
    parse_size,
    sample_choices,
)
from services.api.errors import ApiError, HttpKind, invalid
from services.api.forms import is_form, parse_form
from services.api.serving import api_state, json_response, read_body
from services.api.validation import decode_json_object, load
from shared.deferred import deferred
from shared.errors import ErrorKind

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

log = logging.getLogger("mstar.api.videos")

MAX_JOBS = 64
TTL_S = 3600.0
FPS = 24
MP4 = "video/mp4"


class VideoCreateRequest(PixelFields):
    size: str = "auto"
    seconds: Annotated[int, Meta(ge=1, le=60)] | Annotated[str, Meta(pattern=r"^\d{1,2}$")] | None = None
    num_frames: Annotated[int, Meta(ge=1)] | None = None
    input_reference: Any = None


class VideoError(msgspec.Struct):
    code: str
    message: str


class VideoJob(msgspec.Struct):
    """OpenAI's `Video` object."""

    id: str
    created_at: int
    model: str
    prompt: str
    seconds: str
    size: str
    status: str = "queued"
    progress: int = 0
    object: str = "video"
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None


class Entry:
    """A job, its frames once done, when it may be dropped."""

    def __init__(self, job: VideoJob) -> None:
        self.job = job
        self.frames: np.ndarray | None = None
        self.expires = float("inf")
        self.task: asyncio.Task[None] | None = None
        self.gen: Any = None


class VideoJobs:
    """The api's jobs: bounded in number, each dropped `ttl_s` after it ends."""

    def __init__(self, max_jobs: int = MAX_JOBS, ttl_s: float = TTL_S) -> None:
        self.max_jobs, self.ttl_s = max_jobs, ttl_s
        self.entries: OrderedDict[str, Entry] = OrderedDict()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self.entries.items() if e.expires <= now]:
            del self.entries[key]

    def add(self, entry: Entry) -> None:
        self._expire()
        if len(self.entries) >= self.max_jobs:
            ended = next((k for k, e in self.entries.items() if e.expires != float("inf")), None)
            if ended is None:
                raise ApiError(HttpKind.RATE_LIMITED, f"{self.max_jobs} video jobs are running; retry later")
            del self.entries[ended]
        self.entries[entry.job.id] = entry

    def get(self, job_id: str) -> Entry:
        self._expire()
        entry = self.entries.get(job_id)
        if entry is None:
            raise ApiError(HttpKind.NOT_FOUND, f"no video job {job_id!r} (unknown, or expired)", "video_id")
        return entry

    def ended(self, entry: Entry) -> None:
        entry.expires = time.monotonic() + self.ttl_s
        entry.job.completed_at = int(time.time())
        entry.job.expires_at = int(time.time() + self.ttl_s)


def jobs_of(request: Request) -> VideoJobs:
    jobs: VideoJobs | None = getattr(request.app.state, "video_jobs", None)
    if jobs is None:
        jobs = request.app.state.video_jobs = VideoJobs()
    return jobs


def _body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    if is_form(content_type):
        form = parse_form(raw, content_type)
        if form.file is not None:
            raise invalid("input_reference", "input_reference (image to video) is not served: text to video only")
        return {k: v for k, v in form.fields.items() if v is not None}
    return decode_json_object(raw)


async def create(request: Request) -> Response:
    """POST /v1/videos."""
    try:
        state = api_state(request)
        obj = _body(await read_body(request, state.settings.max_body_bytes), request.headers.get("content-type"))
        req = load(obj, VideoCreateRequest)
        check_served(req, state.settings)
        if req.input_reference is not None:
            raise invalid("input_reference", "input_reference (image to video) is not served: text to video only")
        width, height = parse_size(req.size, state.settings)
        frames = req.num_frames if req.num_frames is not None else FPS * int(req.seconds or 4) + 1
        check_frames(frames, state.settings, "num_frames" if req.num_frames is not None else "seconds")
        options = engine_options(req, state.settings, width, height, frames)
        choice = sample_choices(req.prompt, options, 1, req.request_id)[0]
        job = VideoJob(f"video_{secrets.token_hex(12)}", int(time.time()), state.settings.model_name, req.prompt,
                       f"{frames / FPS:g}", f"{width}x{height}")
        entry = Entry(job)
        jobs_of(request).add(entry)
        try:
            gen = await state.start_generation(choice.params, client_id=choice.params.request_id,
                                               started=time.perf_counter(), task="image")
        except ApiError:
            del jobs_of(request).entries[job.id]
            raise
        job.status, entry.gen = "in_progress", gen
        entry.task = asyncio.get_running_loop().create_task(_run(gen, entry, jobs_of(request), (frames, width,
                                                                                                  height)))
        return json_response(job)
    except ApiError as err:
        return json_response(err.body(), err.status)


async def _run(gen: Any, entry: Entry, jobs: VideoJobs, shape: tuple[int, int, int]) -> None:
    """The job to its end: its frames, or why it failed."""
    job = entry.job
    try:
        done = await gen.collect()
        if done.finish_reason == "abort":
            raise ApiError(ErrorKind.CONFLICT, "the job was deleted before it ended")
        entry.frames = frames_of(done, 0, *shape)
        job.status, job.progress = "completed", 100
    except ApiError as err:
        job.status, job.error = "failed", VideoError(err.code or err.type, err.message)
    except Exception as exc:  # a bug: the job says so, the log says why
        log.exception("video job %s failed", job.id)
        job.status, job.error = "failed", VideoError("internal_error", f"internal error ({type(exc).__name__})")
    jobs.ended(entry)


def _progress(entry: Entry) -> VideoJob:
    """The job, its progress as its outputs last said while it runs (below 100 until its
    frames are here)."""
    job = entry.job
    if job.status == "in_progress" and entry.gen is not None:
        done, total = entry.gen.steps
        if total:
            job.progress = min(99, 100 * done // total)
    return job


async def retrieve(request: Request) -> Response:
    """GET /v1/videos/{video_id}."""
    try:
        return json_response(_progress(jobs_of(request).get(request.path_params["video_id"])))
    except ApiError as err:
        return json_response(err.body(), err.status)


async def delete(request: Request) -> Response:
    """DELETE /v1/videos/{video_id}: the job forgotten (a running one aborted, its pages freed)."""
    try:
        jobs = jobs_of(request)
        entry = jobs.get(request.path_params["video_id"])
        if entry.gen is not None:
            entry.gen.close()
        del jobs.entries[entry.job.id]
        return json_response({"id": entry.job.id, "object": "video.deleted", "deleted": True})
    except ApiError as err:
        return json_response(err.body(), err.status)


async def content(request: Request) -> Response:
    """GET /v1/videos/{video_id}/content[?variant=video|frames]."""
    try:
        entry = jobs_of(request).get(request.path_params["video_id"])
        variant = request.query_params.get("variant", "video")
        if variant not in ("video", "frames"):
            raise invalid("variant", f"variant must be \"video\" or \"frames\", got {variant!r}")
        if entry.frames is None:
            raise ApiError(ErrorKind.CONFLICT, f"video job {entry.job.id} is {entry.job.status}: no content",
                           "video_id")
        if variant == "frames":
            return Response(npy(entry.frames), media_type="application/octet-stream")
        return Response(await asyncio.to_thread(mp4, entry.frames), media_type=MP4)
    except ApiError as err:
        return json_response(err.body(), err.status)


def mp4(frames: np.ndarray, fps: int = FPS) -> bytes:
    """uint8 frames [F, H, W, 3] as an H.264 MP4 (yuv420p, crf 10: near lossless, plays anywhere)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": "10"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
