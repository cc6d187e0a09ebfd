"""openpi's policy-server protocol over a WebSocket at `/` (where openpi's
`WebsocketClientPolicy(host, port)` connects) and `/openpi`, for a robot policy's model.

The protocol (openpi's `serve_policy.py` / `WebsocketPolicyServer`, and `openpi_client`):
on connecting, the server sends one binary frame, its metadata; then each binary frame the
client sends is an observation dict (msgpack with msgpack-numpy arrays) and the server
answers it with one binary frame `{"actions": float32 chunk x max_action_dim,
"policy_timing": {"infer_ms"}, "server_timing": {"infer_ms"}}` (one observation in flight
per socket, as the client waits for each answer; several sockets run at once and are
batched like any requests). How an observation's keys become cameras, state and prompt
(openpi's LIBERO / DROID / ALOHA examples, LeRobot's names) is `openpi_layout.py`.

Each observation becomes the same engine request as `POST /v1/actions` with that body
(`actions.prepare`; the cameras' pixels as lossless PNG files), so the same observation and
noise give the same actions. The actions are the model's (normalized, max_action_dim
wide): mstar applies no robot's output transform. openpi's protocol has no noise:
an observation may carry mstar's `noise` (chunk x max_action_dim) or `seed`, as /v1/actions.

Errors: a refused observation (an unknown key, a missing camera, a state of the wrong
length, ...) is answered by a text frame, the JSON error body of /v1/actions (`{"error":
{"message", "type", "param", "code"}}`), which openpi's client raises as RuntimeError; the
socket stays open for the next observation. A server error is a text frame too, then the
socket is closed with 1011 as openpi's server does. The metadata: `model`, `chunk_size`,
`action_dim`, `cameras` (empty: any), `state_dim` (0: not known).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.websockets import WebSocket

from services.api.actions import prepare
from services.api.errors import ApiError, internal_error, invalid
from services.api.events import encode
from services.api.fanout import FanOut
from services.api.media import check_image
from services.api.metrics import status_label
from services.api.openpi_layout import policy_input, unpack_arrays
from services.api.schemas import ActionRequest, ActionResponse
from services.api.serving import api_state
from services.api.state import ApiState, task_refusal
from services.api.validation import load
from shared.deferred import deferred

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

INTERNAL_ERROR = 1011


def metadata(state: ApiState) -> dict[str, Any]:
    """What the server tells a client on connecting (openpi's `get_server_metadata()`)."""
    s = state.settings
    return {"model": s.model_name, "chunk_size": s.action_shape[0], "action_dim": s.action_shape[1],
            "cameras": list(s.policy_cameras), "state_dim": s.policy_state_size}


def pack_array(arr: np.ndarray) -> dict[bytes, Any]:
    """An array in msgpack-numpy's form (what `openpi_client.msgpack_numpy.unpackb` rebuilds)."""
    arr = np.ascontiguousarray(arr)
    return {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str, b"shape": list(arr.shape)}


def png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)  # HWC uint8: RGB
    return buf.getvalue()


async def openpi_ws(ws: WebSocket) -> None:
    """One client: the metadata, then an answer to each observation, until it goes away."""
    state = api_state(ws)
    await ws.accept()
    if state.settings.task != "act":
        await ws.send_text(encode(invalid("model", task_refusal(state.settings.model_name, state.settings.task,
                                                                  "act")).body()).decode())
        await ws.close(1008)
        return
    await ws.send_bytes(msgspec.msgpack.encode(metadata(state)))
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        try:
            reply: bytes | str = await infer(state, message.get("bytes"))
        except ApiError as err:
            state.metrics.count(status_label(err.status))
            reply = encode(err.body()).decode()
        except Exception as exc:
            state.metrics.count("error_5xx")
            await _send(ws, encode(internal_error("answering an openpi observation", exc).body()).decode())
            with contextlib.suppress(Exception):
                await ws.close(INTERNAL_ERROR, "internal server error; the error is in the previous frame")
            return
        if not await _send(ws, reply):
            return


async def _send(ws: WebSocket, frame: bytes | str) -> bool:
    """Send one frame (bytes: binary, str: text); False once the client has gone (it may
    leave while its observation runs: the answer then has nowhere to go)."""
    try:
        if isinstance(frame, bytes):
            await ws.send_bytes(frame)
        else:
            await ws.send_text(frame)
        return True
    except Exception:  # WebSocketDisconnect, RuntimeError on a closed socket, OSError
        return False


async def infer(state: ApiState, data: bytes | None) -> bytes:
    """One observation frame -> its answer frame (msgpack); ApiError for a refused one."""
    started, arrival = time.perf_counter(), time.time()
    settings = state.settings
    if data is None:
        raise invalid("observation", "an observation is a binary frame (msgpack), not text")
    if len(data) > settings.max_body_bytes:
        raise invalid("observation", f"frame exceeds {settings.max_body_bytes} bytes")
    try:
        obs = unpack_arrays(msgspec.msgpack.decode(data))
    except msgspec.DecodeError as exc:
        raise invalid("observation", f"the frame is not msgpack ({exc})") from exc
    given = policy_input(obs, settings.policy_cameras)
    req = load(given.body, ActionRequest)
    policy = settings.media_policy()
    policy.check_image_count(len(given.cameras), "observation.images")
    images = await asyncio.to_thread(_files, given.cameras, policy)
    prepared = prepare(req, [c.name for c in given.cameras], images, settings)
    gen = await FanOut(prepared.choices, lambda c: state.start_generation(
        c.params, client_id=c.params.request_id, started=started, arrival_time=arrival, task="act"),
        prepared.params.request_id).start()
    try:
        done = await gen.collect()
    finally:
        gen.close()
    reply = prepared.reply.json(done)
    assert isinstance(reply, ActionResponse)
    actions = np.asarray(reply.actions, dtype=np.float32)
    timing = {"infer_ms": (time.perf_counter() - started) * 1000}
    return msgspec.msgpack.encode({"actions": pack_array(actions), "policy_timing": timing, "server_timing": timing})


def _files(cameras: list[Any], policy: Any) -> list[bytes]:
    """Each camera as a PNG file, checked as /v1/actions checks an uploaded one."""
    out = []
    for cam in cameras:
        data = png(cam.pixels)
        check_image(data, cam.key, policy)
        out.append(data)
    return out
