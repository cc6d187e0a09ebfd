"""Robot policies through the real services: tiny random Pi0 and Pi0.5 checkpoints (their
processors saved with them, in the Hub's layout) served at `POST /v1/actions`; the actions
equal transformers' `sample_actions(noise=...)` (processor: PI0Processor / PI05Processor
with the Pillow image backend) within 1e-5 (asked: 1e-4), for one and two cameras of other sizes and two
prompts (Pi0.5: the state's bins in the prompt, some past the quantiles: bins -1 and 255),
one request at a time and four at once; a seed makes the noise reproducible; pages back to zero under
MSTAR_KV_DEBUG_ASSERTS=1; bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.policy_checkpoints import CHUNK, MAX_DIM, STATE_DIM, make_pi0_checkpoint, reference_actions
from tests.servers import MstarServer

CAMERAS = ("base", "wrist")


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


IMAGES = {"wide": png(40, 20, 1), "tall": png(18, 36, 2), "square": png(28, 28, 3), "small": png(10, 12, 4)}
#: case -> (camera -> image, prompt): the Pi0.5 checkpoint needs two named cameras (LeRobot's
#: input_features), the Pi0 one takes any
CASES = [
    ({"base": "wide", "wrist": "tall"}, "pick up the red cube"),
    ({"wrist": "small", "base": "square"}, "open the drawer"),  # sent in another order than the model's
]
ANY_CASES = [({"front": "tall"}, "pick up the red cube"), ({"front": "small", "side": "wide"}, "open_the drawer\n")]


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(IMAGES[name]).decode()


def state(seed: int) -> list[float]:
    """A robot state; its first value past either of Pi0.5's quantiles (bin -1, bin 255)."""
    values = (np.random.default_rng(100 + seed).normal(size=STATE_DIM) * 2).round(4)
    values[0] = 9.0 if seed % 2 else -9.0
    return values.tolist()


def noise(seed: int) -> list[list[float]]:
    return np.random.default_rng(200 + seed).standard_normal((CHUNK, MAX_DIM), dtype=np.float32).tolist()


def body(cameras: dict[str, str], prompt: str, seed: int, **extra) -> dict:
    return {"observation": {"images": {c: data_url(n) for c, n in cameras.items()}, "state": state(seed)},
            "prompt": prompt, "noise": noise(seed), **extra}


def reference(folder: Path, cameras: dict[str, str], order: tuple[str, ...], prompt: str, seed: int) -> np.ndarray:
    import torch
    from PIL import Image

    images = [Image.open(io.BytesIO(IMAGES[cameras[c]])).convert("RGB") for c in order]
    out = reference_actions(folder, [images], [prompt], [state(seed)], torch.tensor([noise(seed)]))
    return out[0].numpy()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pi0")
    return {"pi0": make_pi0_checkpoint(root / "pi0", seed=1),
            "pi05": make_pi0_checkpoint(root / "pi05", seed=2, cameras=CAMERAS, family="pi05")}


@pytest.fixture(scope="module")
def servers(folders, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started: dict[str, MstarServer] = {}
    try:
        for name, folder in folders.items():
            started[name] = MstarServer(str(folder), logs / f"{name}.log", "--num-kv-pages", "64", "--page-size",
                                        "8", env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


async def act(client: httpx.AsyncClient, payload: dict) -> dict:
    r = await client.post("/v1/actions", json=payload)
    assert r.status_code == 200, r.text
    return r.json()


def expected(folders, which: str, cases) -> list[np.ndarray]:
    out = []
    for i, (cameras, prompt) in enumerate(cases):
        order = CAMERAS if which == "pi05" else tuple(cameras)
        out.append(reference(folders[which], cameras, order, prompt, i))
    return out


@pytest.mark.parametrize("which", ["pi0", "pi05"])
def test_actions_equal_transformers(folders, servers, which):
    """Each case alone, then all four at once (two cases twice), equal the reference."""
    cases = CASES if which == "pi05" else ANY_CASES
    want = expected(folders, which, cases)
    srv = servers[which]

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            alone = [await act(client, body(c, p, i)) for i, (c, p) in enumerate(cases)]
            together = await asyncio.gather(*(act(client, body(*cases[i % 2], i % 2)) for i in range(4)))
            return alone, together

    alone, together = asyncio.run(run())
    for i, got in enumerate(alone):
        assert np.asarray(got["actions"]).shape == (CHUNK, MAX_DIM)
        np.testing.assert_allclose(np.asarray(got["actions"]), want[i], atol=1e-5, rtol=0)
        assert got["usage"]["prompt_tokens"] > 0
    for i, got in enumerate(together):
        np.testing.assert_allclose(np.asarray(got["actions"]), want[i % 2], atol=1e-5, rtol=0)
    assert srv.wait_pages_free() == 0


def test_seed_reproducible(servers):
    srv = servers["pi05"]
    payload = body(*CASES[0], 0)
    del payload["noise"]

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            return [await act(client, {**payload, "seed": s}) for s in (7, 7, 8)]

    a, b, c = asyncio.run(run())
    assert a["actions"] == b["actions"] and a["actions"] != c["actions"]
    assert srv.wait_pages_free() == 0


def test_bad_input_names_the_field(servers):
    srv = servers["pi05"]
    good = body(*CASES[0], 0)
    missing = {**good, "observation": {**good["observation"], "images": {"base": data_url("wide")}}}
    short = {**good, "observation": {**good["observation"], "state": [0.0] * (STATE_DIM - 1)}}
    cases = {
        "observation.images.wrist": missing,
        "observation.state": short,
        "noise": {**good, "noise": noise(0)[:-1]},
    }
    wide_noise = {**good, "noise": [[*row, 0.0] for row in noise(0)]}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for param, payload in [*cases.items(), ("noise", wide_noise)]:
            r = client.post("/v1/actions", json=payload)
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param, r.text
        r = client.post("/v1/actions", json={**good, "noise": [[0.0], [0.0, 1.0]]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "noise", r.text
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400, r.text
        card = client.get("/v1/models").json()["data"][0]
        assert card["input_modalities"] == ["text", "image", "state"] and card["output_modalities"] == ["actions"]
    assert srv.wait_pages_free() == 0
