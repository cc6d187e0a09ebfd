"""World models through the real services: a tiny random V-JEPA 2-AC checkpoint (the served
layout: config.json + model.safetensors of `cc-vjepa2`'s state dicts) at
`POST /v1/world/rollout`; each rollout equals the reference's autoregressive rollout
(`cc-vjepa2`'s encoder and AC predictor, stepped as Meta's training code does) within 1e-4
relative, for several clips, action sequences and step counts, alone and many at once; one
clip's encoder runs once for 8 rollouts (the worker's log line per encode); pages back to
zero under MSTAR_KV_DEBUG_ASSERTS=1; the served folder is converted from a Meta-style .pt
(convert_meta_checkpoint); bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.servers import MstarServer
from tests.world_checkpoints import (
    ACTION_DIM,
    EMBED,
    ENCODER,
    IMG,
    PREDICTOR,
    TOKENS,
    make_world_checkpoint,
    reference_rollout,
)

SEED = 3


def clip(seed: int, frames: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (IMG, IMG, 3), dtype=np.uint8) for _ in range(frames)]


def png(frame: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).normal(size=(n, ACTION_DIM)).astype(np.float32)


def body(frames: list[np.ndarray], seed: int, steps: int) -> dict:
    n = len(frames) + steps - 1
    return {"frames": [png(f) for f in frames], "actions": rows(seed, n).tolist(),
            "states": rows(seed + 500, n).tolist(), "steps": steps}


def expected(frames: list[np.ndarray], seed: int, steps: int) -> np.ndarray:
    n = len(frames) + steps - 1
    return reference_rollout(SEED, frames, rows(seed, n), rows(seed + 500, n), steps)


def decoded(reply: dict) -> np.ndarray:
    assert reply["object"] == "list"
    out = []
    for i, item in enumerate(reply["data"]):
        assert item["index"] == i and item["shape"] == [TOKENS, EMBED]
        out.append(np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").reshape(TOKENS, EMBED))
    return np.stack(out)


def clip_key(frames: list[np.ndarray]) -> str:
    """The clip's content key as the data worker computes it (the PNG bytes sent, hashed)."""
    from shared.specs.world import WorldSpec

    spec = WorldSpec({"encoder": ENCODER, "predictor": PREDICTOR}, page_size=8)
    return spec.clip_key(tuple(spec.prepare_image(base64.b64decode(png(f).split(",")[1])) for f in frames))


def close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-4, rel


def from_meta_pt(root: Path) -> Path:
    """The served folder converted from a Meta-style .pt (the checkpoint's state dicts under
    `module.`, as `vjepa2-ac-vitg.pt` holds them), whose tensors must be the folder's."""
    import torch
    from safetensors.torch import load_file

    from services.gpu_worker.modeling.world.convert import convert_meta_checkpoint

    folder = make_world_checkpoint(root / "made", SEED)
    state = load_file(str(folder / "model.safetensors"))
    parts = {part: {f"module.backbone.{k.split('.', 1)[1]}": v for k, v in state.items() if k.startswith(part)}
             for part in ("encoder", "predictor")}
    torch.save(parts, root / "vjepa2-ac.pt")
    out = convert_meta_checkpoint(root / "vjepa2-ac.pt", root / "vjepa2-ac",
                                  json.loads((folder / "config.json").read_text()))
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == state.keys() and all(torch.equal(converted[k], state[k]) for k in state)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vjepa")
    folder = from_meta_pt(root)
    srv = MstarServer(str(folder), root / "serve.log", "--num-kv-pages", "64", "--page-size", "8",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    try:
        yield srv
    finally:
        srv.stop()


async def post(client: httpx.AsyncClient, payload: dict) -> dict:
    r = await client.post("/v1/world/rollout", json=payload)
    assert r.status_code == 200, r.text
    return r.json()


CASES = [(clip(1, 1), 1, 3), (clip(2, 2), 2, 2), (clip(3, 3), 3, 4)]  # (clip, action seed, steps)


def test_rollouts_equal_reference(server):
    """Each case alone, then all of them and again at once (their steps batched)."""
    want = [expected(*case) for case in CASES]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            alone = [await post(client, body(*case)) for case in CASES]
            together = await asyncio.gather(*(post(client, body(*CASES[i % 3])) for i in range(6)))
            return alone, together

    alone, together = asyncio.run(run())
    for i, got in enumerate(alone):
        close(decoded(got), want[i])
    for i, got in enumerate(together):
        close(decoded(got), want[i % 3])
    assert server.wait_pages_free() == 0


def test_one_clip_encoded_once_for_8_rollouts(server):
    """A planner's 8 candidates from one clip (4 one after another, 4 at once): the clip is
    encoded once (one log line for its key), and each rollout equals the reference."""
    frames = clip(42, 2)
    seeds = list(range(50, 58))
    want = [expected(frames, s, 3) for s in seeds]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            first = [await post(client, body(frames, s, 3)) for s in seeds[:4]]
            rest = await asyncio.gather(*(post(client, body(frames, s, 3)) for s in seeds[4:]))
            return [*first, *rest]

    encoded = server.metric("mstar_world_clip_encodes_total")
    got = asyncio.run(run())
    assert server.wait_metric("mstar_world_clip_encodes_total", encoded + 1) == encoded + 1
    for g, w in zip(got, want):
        close(decoded(g), w)
    encodes = [line for line in server.log().splitlines() if "world encoder: clip" in line]
    assert sum(f"clip {clip_key(frames)[:16]} encoded" in line for line in encodes) == 1, encodes
    keys = [line.split("clip ")[1].split()[0] for line in encodes]
    assert len(keys) == len(set(keys)), encodes  # no clip of any test encoded twice
    assert server.wait_pages_free() == 0


def test_models_names_the_modalities(server):
    card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["input_modalities"] == ["image", "actions", "state"] and card["output_modalities"] == ["embedding"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=10)
    assert r.status_code == 400 and "/v1/world/rollout" in r.json()["error"]["message"], r.text


def test_bad_input_names_the_field(server):
    good = body(clip(1, 2), 1, 2)
    not_image = "data:image/png;base64," + base64.b64encode(b"no").decode()
    cases = {
        "actions": {**good, "actions": good["actions"][:-1]},
        "states": {**good, "states": [*good["states"], [0.0] * ACTION_DIM]},
        "frames.1": {**good, "frames": [good["frames"][0], not_image]},
        "steps": {**good, "steps": 0},
        "frames": {**good, "frames": []},
    }
    wide = {**good, "actions": [[*row, 0.0] for row in good["actions"]]}
    not_url = {**good, "frames": ["hello", good["frames"][1]]}
    ragged = {**good, "states": [good["states"][0][:-1], *good["states"][1:]]}
    too_long = {**good, "steps": 9, "actions": rows(1, 10).tolist(), "states": rows(2, 10).tolist()}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        more = [("actions", wide), ("frames.0", not_url), ("states", ragged), ("steps", too_long)]
        for param, payload in [*cases.items(), *more]:
            r = client.post("/v1/world/rollout", json=payload)
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param, (param, r.text)
    assert server.wait_pages_free() == 0
