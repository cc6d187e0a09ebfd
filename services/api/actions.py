"""`POST /v1/actions`: a robot policy's next chunk of actions (Pi0).

Body: `{model?, observation: {images: {camera: data URL, ...}, state: [...]}, prompt?,
noise?, seed?}`; reply `{id, object: "actions", model, actions: chunk x action_dim,
usage: {prompt_tokens, total_tokens}}` (prompt_tokens: the prefix's rows, image rows
included). The same `noise` (chunk x max_action_dim) gives transformers'
`sample_actions(noise=...)`; without it a `seed` draws the noise reproducibly, else it is
random. One engine request per body, never streamed (a pooling route's path: its one
output carries the actions as float32 bytes). The api checks the body's shapes (a ragged
noise, a non-numeric state); the data worker checks them against the model (a missing
camera, a state of the wrong length, noise of the wrong shape), each a 400 naming the
field (`observation.images.<camera>`, `observation.state`, `noise`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api.chat_request import check_model
from services.api.embeddings import PooledReply, pooled
from services.api.errors import invalid
from services.api.events import DoneEvent
from services.api.fanout import Choice
from services.api.media import load_image
from services.api.schemas import ActionRequest, ActionResponse, ActionUsage
from services.api.serving import Prepared, serve
from services.api.settings import ApiSettings
from services.api.state import ApiState, task_refusal
from services.api.streaming import EventStream
from services.api.validation import GenerateParams, load, new_request_id
from shared.deferred import deferred
from shared.frames import SamplingParams

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)


def floats(req: ActionRequest) -> tuple[dict[str, list[float]], dict[str, int | str | float | bool]]:
    """(the numeric inputs for the data worker, the options): the noise flattened with its
    row count (the spec checks its shape), a 400 for a ragged one."""
    out = {"state": list(req.observation.state)}
    options: dict[str, int | str | float | bool] = {}
    if req.noise is not None:
        widths = {len(row) for row in req.noise}
        if len(widths) > 1:
            raise invalid("noise", f"noise must be a chunk x action_dim matrix; its rows have {sorted(widths)} values")
        out["noise"] = [v for row in req.noise for v in row]
        options["noise_rows"] = len(req.noise)
    if req.seed is not None:
        options["seed"] = req.seed
    return out, options


async def accept(obj: Any, state: ApiState) -> Prepared:
    settings = state.settings
    if settings.task != "act":
        raise invalid("model", task_refusal(settings.model_name, settings.task, "act"))
    req = load(obj, ActionRequest)
    check_model(req.model, settings.model_name)
    policy = settings.media_policy()
    cameras = list(req.observation.images)
    policy.check_image_count(len(cameras), "observation.images")
    images = [await load_image(req.observation.images[name], f"observation.images.{name}", policy)
              for name in cameras]
    return prepare(req, cameras, images, settings)


def prepare(req: ActionRequest, cameras: list[str], images: list[bytes], settings: ApiSettings) -> Prepared:
    """The engine request of a checked body whose cameras' image files are `images` (in
    `cameras`' order); shared with the openpi WebSocket (`openpi.py`), which brings its
    cameras as arrays, so both paths submit the same request for the same observation."""
    numbers, options = floats(req)
    request_id = req.request_id or new_request_id()
    params = GenerateParams(request_id=request_id, sampling=SamplingParams(), max_tokens=1, prompt=req.prompt,
                            add_special_tokens=False, options=options, images=tuple(images),
                            cameras=tuple(cameras), floats=numbers)
    chunk, width = settings.action_shape

    def answer(dones: list[DoneEvent], rid: str, created: int) -> msgspec.Struct:
        done = dones[0]
        actions = np.frombuffer(pooled(done, 0), dtype="<f4").reshape(chunk, width)
        tokens = done.usage.prompt_tokens
        return ActionResponse(f"act-{rid}", settings.model_name, actions.tolist(), ActionUsage(tokens, tokens))

    return Prepared(params, False, PooledReply(answer, request_id), [Choice(params, None)], "act")


async def actions(request: Request) -> Response | EventStream:
    """POST /v1/actions."""
    return await serve(request, accept, "/v1/actions")
