"""openpi's WebSocket policy protocol through the real services, driven by openpi's own client
(`openpi_client.WebsocketClientPolicy`, unchanged: it connects to ws://host:port).

A tiny random Pi0.5 whose cameras are openpi's slots (`base_0_rgb`, `left_wrist_0_rgb`, in
LeRobot's input_features): LIBERO's keys (`observation/image` -> base_0_rgb,
`observation/wrist_image` -> left_wrist_0_rgb, uint8 HWC) and LeRobot's
(`observation.images.<name>`, float CHW in [0, 1], `task`) give the same actions as
`POST /v1/actions` with the same noise (openpi's protocol has none: the observation carries
mstar's `noise`, or its `seed`, so both paths denoise the same draw), and transformers'
`sample_actions` within 1e-5; refused observations are a text frame naming the key (openpi's
client raises it) and the socket serves the next one; four clients at once each get their
own actions; pages back to zero under MSTAR_KV_DEBUG_ASSERTS=1.
"""

from __future__ import annotations

import base64
import io
import threading

import httpx
import numpy as np
import pytest

from tests.policy_checkpoints import CHUNK, MAX_DIM, STATE_DIM, make_pi0_checkpoint, reference_actions
from tests.servers import MstarServer

openpi_client = pytest.importorskip("openpi_client.websocket_client_policy")

CAMERAS = ("base_0_rgb", "left_wrist_0_rgb")


def image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def data_url(pixels: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def state(seed: int) -> np.ndarray:
    return (np.random.default_rng(100 + seed).normal(size=STATE_DIM) * 2).astype(np.float32)


def noise(seed: int) -> np.ndarray:
    return np.random.default_rng(200 + seed).standard_normal((CHUNK, MAX_DIM), dtype=np.float32)


def libero(seed: int, prompt: str) -> tuple[dict, dict]:
    """(openpi's LIBERO observation with mstar's noise, the /v1/actions body of the same)."""
    base, wrist = image(20, 40, seed), image(36, 18, seed + 1)
    obs = {"observation/image": base, "observation/wrist_image": wrist, "observation/state": state(seed),
           "prompt": prompt, "noise": noise(seed)}
    body = {"observation": {"images": {"base_0_rgb": data_url(base), "left_wrist_0_rgb": data_url(wrist)},
                            "state": state(seed).tolist()}, "prompt": prompt, "noise": noise(seed).tolist()}
    return obs, body


def lerobot(seed: int, prompt: str) -> tuple[dict, dict]:
    """LeRobot's names, float CHW images in [0, 1], a seed; the body with the uint8 images
    openpi's parse makes of them (255 * x, truncated)."""
    base = np.random.default_rng(seed).random((3, 24, 24), dtype=np.float32)
    wrist = np.random.default_rng(seed + 1).random((3, 16, 30), dtype=np.float32)
    obs = {"observation.images.left_wrist_0_rgb": wrist, "observation.images.base_0_rgb": base,
           "observation.state": state(seed)[None], "task": prompt, "seed": 11}
    as_uint8 = [(255 * x).astype(np.uint8).transpose(1, 2, 0) for x in (base, wrist)]
    body = {"observation": {"images": dict(zip(CAMERAS, map(data_url, as_uint8), strict=True)),
                            "state": state(seed).tolist()}, "prompt": prompt, "seed": 11}
    return obs, body


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_pi0_checkpoint(tmp_path_factory.mktemp("pi05") / "pi05", seed=3, cameras=CAMERAS, family="pi05")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "pi05.log", "--num-kv-pages", "64",
                      "--page-size", "8", env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    yield srv
    srv.stop()


def client(srv: MstarServer):
    return openpi_client.WebsocketClientPolicy(host="127.0.0.1", port=srv.port)


def http_actions(srv: MstarServer, body: dict) -> np.ndarray:
    r = httpx.post(srv.url + "/v1/actions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["actions"], dtype=np.float32)


def test_same_actions_as_v1_actions(folder, server):
    policy = client(server)
    assert policy.get_server_metadata() == {"model": server_name(server), "chunk_size": CHUNK,
                                            "action_dim": MAX_DIM, "cameras": list(CAMERAS), "state_dim": STATE_DIM}
    for make, prompt in ((libero, "pick up the red cube"), (lerobot, "open the drawer")):
        obs, body = make(1, prompt)
        got = policy.infer(obs)
        assert got["actions"].dtype == np.float32 and got["actions"].shape == (CHUNK, MAX_DIM)
        assert got["server_timing"]["infer_ms"] > 0
        np.testing.assert_array_equal(got["actions"], http_actions(server, body))
    obs, body = libero(1, "pick up the red cube")
    import torch
    from PIL import Image

    images = [Image.fromarray(obs["observation/image"]), Image.fromarray(obs["observation/wrist_image"])]
    want = reference_actions(folder, [images], [body["prompt"]], [body["observation"]["state"]],
                             torch.tensor(noise(1)[None]))
    np.testing.assert_allclose(policy.infer(obs)["actions"], want[0].numpy(), atol=1e-5, rtol=0)
    policy._ws.close()
    assert server.wait_pages_free() == 0


def server_name(srv: MstarServer) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_refusals_name_the_key(server):
    import websockets.sync.client

    policy = client(server)
    good, _ = libero(2, "stack the blocks")
    bad = {
        "depth": {**good, "depth": 1},
        "observation": {k: v for k, v in good.items() if "image" not in k},
        "left_wrist_0_rgb": {k: v for k, v in good.items() if k != "observation/wrist_image"},
        "observation/gripper": {**good, "observation/gripper": np.zeros((4, 4, 3), np.uint8)},
        "observation.state": {**good, "observation/state": state(0)[:-1]},
        "noise": {**good, "noise": noise(0)[:-1]},
        "observation/image": {**good, "observation/image": np.zeros((4, 4), np.uint8)},
    }
    for key, obs in bad.items():
        with pytest.raises(RuntimeError) as info:
            policy.infer(obs)
        assert f'"param":"{key}"' in str(info.value), (key, str(info.value))
    assert policy.infer(good)["actions"].shape == (CHUNK, MAX_DIM)  # the socket still serves
    with websockets.sync.client.connect(f"ws://127.0.0.1:{server.port}/openpi") as ws:
        ws.recv()  # the metadata
        ws.send(b"\xc1 not msgpack")
        assert '"param":"observation"' in ws.recv()
        ws.send("a text frame")
        assert "binary frame" in ws.recv()
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200
    policy._ws.close()
    assert server.wait_pages_free() == 0


def test_several_clients_at_once(server):
    """Four openpi clients, each its own socket, two observations each, all at once."""
    cases = [libero(10 + i, f"task {i}") for i in range(4)]
    want = [http_actions(server, body) for _, body in cases]
    got: dict[int, list[np.ndarray]] = {}
    start = threading.Barrier(4)

    def drive(i: int) -> None:
        policy = client(server)
        start.wait()
        got[i] = [policy.infer(cases[i][0])["actions"], policy.infer(cases[(i + 1) % 4][0])["actions"]]
        policy._ws.close()

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(got) == [0, 1, 2, 3]
    for i, (first, second) in got.items():
        np.testing.assert_allclose(first, want[i], atol=1e-5, rtol=0)
        np.testing.assert_allclose(second, want[(i + 1) % 4], atol=1e-5, rtol=0)
    assert server.wait_pages_free() == 0
