"""`POST /v1/world/rollout`: a world model's rollout (V-JEPA 2-AC).

Body: `{model?, frames: [data URL, ...] (the context clip), actions: [[...]], states: [[...]]
(one row per context frame and per step but the last: frames + steps - 1 rows each),
steps}`; reply `{"object": "list", "model", "data": [{"index", "shape", "embedding"}]}`, one
item per predicted step, its embedding the predicted frame's tokens (tokens x embed_dim)
as base64 little-endian float32. One engine request per body, never streamed (a pooling
route's path: its one output carries the predictions as float32 bytes). The api checks
the body's shapes (ragged rows) and fetches the frames (`frames.<i>` names one it cannot
use); the data worker checks the rows against the model and the steps, each a 400
naming the field (`frames.<i>`, `actions`, `states`, `steps`).
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api.chat_request import check_model
from services.api.embeddings import PooledReply, pooled
from services.api.errors import invalid
from services.api.events import DoneEvent
from services.api.fanout import Choice
from services.api.media import load_image
from services.api.schemas import RolloutItem, RolloutRequest, RolloutResponse
from services.api.serving import Prepared, serve
from services.api.state import ApiState, task_refusal
from services.api.streaming import EventStream
from services.api.validation import GenerateParams, load, new_request_id
from shared.frames import SamplingParams


def matrices(req: RolloutRequest) -> tuple[dict[str, list[float]], dict[str, int | str | float | bool]]:
    """(actions and states flattened, their row counts and the steps as options); a 400 for
    a ragged matrix (the data worker checks the rows and widths against the model)."""
    out: dict[str, list[float]] = {}
    options: dict[str, int | str | float | bool] = {"steps": req.steps}
    for name, rows in (("actions", req.actions), ("states", req.states)):
        widths = {len(row) for row in rows}
        if len(widths) > 1:
            raise invalid(name, f"{name} must be a matrix (rows x action dim); its rows have {sorted(widths)} values")
        out[name] = [v for row in rows for v in row]
        options[f"{name}_rows"] = len(rows)
    return out, options


async def accept(obj: Any, state: ApiState) -> Prepared:
    settings = state.settings
    if settings.task != "rollout":
        raise invalid("model", task_refusal(settings.model_name, settings.task, "rollout"))
    req = load(obj, RolloutRequest)
    check_model(req.model, settings.model_name)
    if not req.frames:
        raise invalid("frames", "frames must hold at least one image (the context clip)")
    policy = settings.media_policy()
    policy.check_image_count(len(req.frames), "frames")
    images = [await load_image(url, f"frames.{i}", policy) for i, url in enumerate(req.frames)]
    numbers, options = matrices(req)
    request_id = req.request_id or new_request_id()
    params = GenerateParams(request_id=request_id, sampling=SamplingParams(), max_tokens=1,
                            add_special_tokens=False, options=options, images=tuple(images), floats=numbers)
    tokens, width = settings.world_shape

    def answer(dones: list[DoneEvent], rid: str, created: int) -> msgspec.Struct:
        data = pooled(dones[0], 0)
        step = tokens * width * 4
        items = [RolloutItem(i, [tokens, width], base64.b64encode(data[i * step:(i + 1) * step]).decode())
                 for i in range(len(data) // step)]
        return RolloutResponse(items, settings.model_name)

    return Prepared(params, False, PooledReply(answer, request_id), [Choice(params, None)], "rollout")


async def rollout(request: Request) -> Response | EventStream:
    """POST /v1/world/rollout."""
    return await serve(request, accept, "/v1/world/rollout")
