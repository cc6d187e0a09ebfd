"""`POST /v1/images/generations` (OpenAI's image API) for a text-to-image model (Cosmos 3),
and what the video job API (`videos.py`) shares with it: the size, the extensions, the
engine requests.

Body: `prompt`, `n` (1..`MAX_N`), `size` ("WxH"; "auto": the pipeline's 1280x720),
`response_format` ("b64_json": OpenAI's other, "url", needs storage this server does not
keep), `output_format` ("png"; "npy": the float32 image [H, W, 3] in [0, 1] as a .npy file,
for exact checks), `model`, `user`; extensions as vLLM-Omni takes them: `seed`,
`num_inference_steps`, `guidance_scale`, `negative_prompt`. Reply `{created, data:
[{b64_json}], output_format, size}`.

Each of the `n` images is its own engine request (they share one step and its forward),
sample j of the seed (`sample`: the j-th draw of one generator, as the pipeline's j-th
call on it); without a seed one is drawn here, so every reply can be reproduced from the
logs. A size the model cannot make (not a multiple of its patch in pixels, past its
largest side), `n` or steps past their limits are a 400 naming the field, before
anything is queued (`ApiSettings.image_limits`, the spec's).
"""

from __future__ import annotations

import base64
import io
import re
import secrets
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec
from msgspec import Meta

from services.api.chat_request import check_model
from services.api.embeddings import pooled, prepared
from services.api.errors import invalid
from services.api.events import DoneEvent
from services.api.fanout import Choice
from services.api.schemas import SEED_MAX, Body
from services.api.serving import Prepared
from services.api.settings import ApiSettings
from services.api.state import ApiState, task_refusal
from services.api.validation import GenerateParams, load, new_request_id
from shared.deferred import deferred
from shared.frames import SamplingParams

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: images one request may ask for
MAX_N = 4
#: the pipeline's defaults (`Cosmos3OmniPipeline.__call__`)
DEFAULT_SIZE = (1280, 720)
DEFAULT_STEPS = 35
DEFAULT_GUIDANCE = 6.0
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


class PixelFields(Body):
    """The prompt and the extensions both routes take (vLLM-Omni's names)."""

    prompt: str
    seed: Annotated[int, Meta(ge=0, le=SEED_MAX)] | None = None
    num_inference_steps: Annotated[int, Meta(ge=1)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    negative_prompt: str | None = None
    model: str | None = None
    user: str | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None


class ImageGenerationRequest(PixelFields):
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    size: str = "auto"
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png", "npy"] = "png"


class ImageData(msgspec.Struct, omit_defaults=True):
    b64_json: str


class ImagesResponse(msgspec.Struct):
    created: int
    data: list[ImageData]
    output_format: str
    size: str


def parse_size(size: str, settings: ApiSettings) -> tuple[int, int]:
    """(width, height) of "WxH" ("auto": the pipeline's default); a 400 naming `size` for one
    the model cannot make."""
    if size == "auto":
        width, height = DEFAULT_SIZE
    else:
        m = _SIZE.match(size)
        if m is None:
            raise invalid("size", f"size must be \"WxH\" (e.g. \"1280x720\") or \"auto\", got {size!r}")
        width, height = int(m.group(1)), int(m.group(2))
    multiple, _, max_side, _, _ = settings.image_limits
    for side in (width, height):
        if side < multiple or side > max_side or side % multiple:
            raise invalid("size", f"size must be WxH with each side a multiple of {multiple} from {multiple} to "
                                  f"{max_side} (the model's latent patch in pixels), got {size}")
    return width, height


def check_frames(num_frames: int, settings: ApiSettings, param: str = "num_frames") -> None:
    _, temporal, _, max_frames, _ = settings.image_limits
    if num_frames < 1 or num_frames > max_frames or (num_frames - 1) % temporal:
        raise invalid(param, f"{param} must be 1 + a multiple of {temporal} (frames per latent frame), at most "
                             f"{max_frames}, got {num_frames}")


def check_served(req: PixelFields, settings: ApiSettings) -> None:
    """An image model, and the one the body names (else 400 / 404 naming `model`)."""
    if settings.task != "image":
        raise invalid("model", task_refusal(settings.model_name, settings.task, "image"))
    check_model(req.model, settings.model_name)


def engine_options(req: PixelFields, settings: ApiSettings, width: int, height: int,
                   num_frames: int) -> dict[str, int | str | float | bool]:
    """The data worker's options for one sample (`sample` set per choice); a 400 naming
    `num_inference_steps` past the model's loop cap."""
    steps = req.num_inference_steps if req.num_inference_steps is not None else DEFAULT_STEPS
    if steps > settings.image_limits[4]:
        raise invalid("num_inference_steps", f"num_inference_steps must be at most {settings.image_limits[4]} "
                                             f"(the denoising loop's cap), got {steps}")
    options: dict[str, int | str | float | bool] = {
        "height": height, "width": width, "num_frames": num_frames, "num_inference_steps": steps,
        "guidance_scale": float(req.guidance_scale if req.guidance_scale is not None else DEFAULT_GUIDANCE),
        "seed": req.seed if req.seed is not None else secrets.randbelow(SEED_MAX + 1)}
    if req.negative_prompt is not None:
        options["negative_prompt"] = req.negative_prompt
    return options


def sample_choices(prompt: str, options: dict[str, int | str | float | bool], n: int,
                   request_id: str | None) -> list[Choice]:
    """One engine request per sample: sample j of the seed."""
    rid = request_id or new_request_id()
    base = GenerateParams(request_id=rid, sampling=SamplingParams(), max_tokens=1, prompt=prompt,
                          add_special_tokens=False)
    return [Choice(msgspec.structs.replace(base, request_id=f"{rid}-{j}", options={**options, "sample": j}), None)
            for j in range(n)]


def frames_of(done: DoneEvent, i: int, num_frames: int, width: int, height: int) -> np.ndarray:
    """A sample's frames [F, H, W, 3] as the worker sends them: an image's float32 in [0, 1],
    a video's uint8 (already rounded: runners/diffusion.py `frame_bytes`)."""
    dtype = "<f4" if num_frames == 1 else "u1"
    return np.frombuffer(pooled(done, i), dtype=dtype).reshape(num_frames, height, width, 3)


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """diffusers' `numpy_to_pil`: (x * 255).round() as uint8."""
    return (frames * 255).round().astype(np.uint8)


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(buf, format="PNG")
    return buf.getvalue()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def images_prepared(req: ImageGenerationRequest, choices: list[Choice], width: int, height: int) -> Prepared:
    """The engine requests of an image route (generations, edits) and the reply their
    images make: each PNG (or .npy), in order."""

    def answer(dones: list[DoneEvent], rid: str, created: int) -> msgspec.Struct:
        data = []
        for i, done in enumerate(dones):
            image = frames_of(done, i, 1, width, height)[0]
            raw = png(image) if req.output_format == "png" else npy(image)
            data.append(ImageData(base64.b64encode(raw).decode()))
        return ImagesResponse(created, data, req.output_format, f"{width}x{height}")

    return prepared(choices, answer, "image")


def accept(obj: dict, state: ApiState) -> Prepared:
    settings = state.settings
    req = load(obj, ImageGenerationRequest)
    check_served(req, settings)
    width, height = parse_size(req.size, settings)
    options = engine_options(req, settings, width, height, 1)
    return images_prepared(req, sample_choices(req.prompt, options, req.n, req.request_id), width, height)
