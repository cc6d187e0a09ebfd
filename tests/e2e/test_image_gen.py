"""Images and video out through the real services: a tiny random Cosmos 3 pipeline in the
diffusers layout (tests/cosmos_checkpoints.py) behind `POST /v1/images/generations` and the
video job API, each output equal to the diffusers pipeline's (`Cosmos3OmniPipeline`,
float32, `generator=torch.Generator("cpu").manual_seed(seed)`) for the same seed, steps,
guidance and size: uint8 within 1 (the PNG's pixels; the `npy` float image within 1e-4);
two sizes, CFG on and off, a negative prompt, n = 2 (the pipeline's calls one after
another on one generator); a 5-frame video's frames (`?variant=frames`) equal the
pipeline's and its MP4 decodes (PyAV) to frames close to them; 4 requests at once give
the pixels one at a time gives; a 100-step video job's progress moves between 0 and 100
(one iteration a worker step) while an image is served beside it; bad input is a 400
naming the field, a job refused after it started says why; pages back to zero under MSTAR_KV_DEBUG_ASSERTS=1.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import pytest

from tests.cosmos_checkpoints import load_pipeline, make_cosmos3, reference_frames, to_uint8
from tests.servers import MstarServer, assert_clean

STEPS = 2
#: (body extensions, n): each the pipeline's call with the same values
IMAGES = {
    "cfg": ({"prompt": "a red fox", "size": "32x32", "seed": 3, "guidance_scale": 6.0}, 1),
    "wide_no_cfg": ({"prompt": "a red fox", "size": "48x32", "seed": 4, "guidance_scale": 1.0}, 1),
    "negative": ({"prompt": "the quick dog", "size": "32x32", "seed": 5, "guidance_scale": 4.0,
                  "negative_prompt": "blurry, dark"}, 1),
    "n2": ({"prompt": "hello world", "size": "32x48", "seed": 9, "guidance_scale": 3.0}, 2),
}
VIDEO = {"prompt": "a video of a fox", "size": "32x32", "num_frames": 5, "seed": 7, "guidance_scale": 5.0}


def _reference(pipe, body: dict, n: int) -> list[np.ndarray]:
    width, height = (int(v) for v in body["size"].split("x"))
    return reference_frames(pipe, body["prompt"], height=height, width=width, num_frames=body.get("num_frames", 1),
                            seed=body["seed"], steps=STEPS, guidance_scale=body["guidance_scale"],
                            negative_prompt=body.get("negative_prompt"), n=n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(server, references): the server starts while the pipeline computes the references."""
    root = tmp_path_factory.mktemp("cosmos3")
    folder = make_cosmos3(root / "tiny-cosmos3")
    srv = MstarServer(str(folder), root / "serve.log", "--num-kv-pages", "64", "--page-size", "16",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).launch()
    try:
        pipe = load_pipeline(folder)
        refs = {name: _reference(pipe, body, n) for name, (body, n) in IMAGES.items()}
        refs["video"] = _reference(pipe, VIDEO, 1)
        srv.wait_ready()
        yield srv, refs
    finally:
        srv.stop()


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def _png_pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _close(got: np.ndarray, want_float: np.ndarray) -> None:
    want = to_uint8(want_float)
    assert got.shape == want.shape and got.dtype == np.uint8
    assert np.abs(got.astype(int) - want).max() <= 1


def _body(name: str) -> dict:
    body, n = IMAGES[name]
    return {**body, "n": n, "num_inference_steps": STEPS}


def test_images_equal_the_pipeline(setup):
    """Through the official client (`images.generate`, the extensions in extra_body)."""
    import openai

    srv, refs = setup
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    for name, (body, n) in IMAGES.items():
        extra = {k: v for k, v in body.items() if k not in ("prompt", "size")}
        reply = client.images.generate(prompt=body["prompt"], size=body["size"], n=n, response_format="b64_json",
                                       extra_body={**extra, "num_inference_steps": STEPS})
        assert len(reply.data) == n
        for item, ref in zip(reply.data, refs[name]):
            _close(_png_pixels(item.b64_json), ref[0])
    a, b = refs["n2"]
    assert not np.array_equal(to_uint8(a), to_uint8(b))  # two samples of one seed differ


def test_npy_is_the_float_image(setup):
    srv, refs = setup
    r = httpx.post(srv.url + "/v1/images/generations", json={**_body("negative"), "output_format": "npy"}, timeout=60)
    assert r.status_code == 200, r.text
    got = np.load(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert got.dtype == np.float32 and np.abs(got - refs["negative"][0][0]).max() < 1e-4


def test_four_at_once_equal_one_at_a_time(setup):
    srv, refs = setup

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            names = ["cfg", "wide_no_cfg", "negative", "n2"]
            replies = await asyncio.gather(*(c.post("/v1/images/generations", json=_body(n)) for n in names))
            return [r.json() for r in replies]

    for name, reply in zip(["cfg", "wide_no_cfg", "negative", "n2"], asyncio.run(run())):
        for item, ref in zip(reply["data"], refs[name]):
            _close(_png_pixels(item["b64_json"]), ref[0])


def _wait(client, video_id: str):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = client.videos.retrieve(video_id)
        if job.status in ("completed", "failed"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"video job {video_id} did not end")


def test_video_frames_and_mp4(setup):
    """`videos.create` as the official client sends it (multipart), its frames and its MP4."""
    import av
    import openai

    srv, refs = setup
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    extra = {k: v for k, v in VIDEO.items() if k not in ("prompt", "size")}
    job = client.videos.create(prompt=VIDEO["prompt"], size=VIDEO["size"],
                               extra_body={**extra, "num_inference_steps": STEPS})
    assert job.status in ("queued", "in_progress") and job.object == "video"
    job = _wait(client, job.id)
    assert job.status == "completed" and job.progress == 100, job
    want = refs["video"][0]
    r = httpx.get(f"{srv.url}/v1/videos/{job.id}/content", params={"variant": "frames"})
    frames = np.load(io.BytesIO(r.content))
    assert frames.shape == (5, 32, 32, 3)
    _close(frames, want)
    mp4 = client.videos.download_content(job.id).content
    with av.open(io.BytesIO(mp4)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert decoded.shape == frames.shape
    # H.264 4:2:0 keeps luma at full resolution (chroma at half): the frames' luma, near lossless at crf 10
    luma = np.array([0.299, 0.587, 0.114])
    assert np.abs(decoded @ luma - frames @ luma).mean() < 2.5


def test_video_progress_moves_beside_an_image(setup):
    """The loop runs one iteration a worker step: while a 100-step video runs, its job's
    `progress` moves through values between 0 and 100 (never back), and a 1-step image sent
    meanwhile is served beside it. (That the image ends before the video, in the step after
    it arrives, is tests/unit/test_cosmos3_engine.py's: counted in steps, not timed.)"""
    srv, _ = setup

    async def run() -> tuple[list[tuple[str, int]], httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            r = await c.post("/v1/videos", json={**VIDEO, "size": "64x64", "num_frames": 9, "seed": 11,
                                                 "num_inference_steps": 100})
            assert r.status_code == 200, r.text
            video_id = r.json()["id"]

            async def poll() -> list[tuple[str, int]]:
                seen: list[tuple[str, int]] = []
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    job = (await c.get(f"/v1/videos/{video_id}")).json()
                    seen.append((job["status"], job["progress"]))
                    if job["status"] != "in_progress":
                        break
                    await asyncio.sleep(0.005)
                return seen

            image = c.post("/v1/images/generations", json={**_body("wide_no_cfg"), "num_inference_steps": 1})
            seen, reply = await asyncio.gather(poll(), image)
            return seen, reply

    seen, reply = asyncio.run(run())
    assert reply.status_code == 200 and len(reply.json()["data"]) == 1, reply.text
    assert seen[-1] == ("completed", 100), seen[-3:]
    assert any(status == "in_progress" and 0 < p < 100 for status, p in seen), seen  # it moved with the iterations
    assert [p for _, p in seen] == sorted(p for _, p in seen)  # never backwards


def test_bad_input_and_failed_job(setup):
    srv, _ = setup
    cases = [("/v1/images/generations", {"prompt": "x", "size": "30x32"}, "size"),
             ("/v1/images/generations", {"prompt": "x", "size": "4096x32"}, "size"),
             ("/v1/images/generations", {"prompt": "x", "size": "32x32", "n": 5}, "n"),
             ("/v1/images/generations", {"prompt": "x", "size": "32x32", "num_inference_steps": 101},
              "num_inference_steps"),
             ("/v1/images/generations", {"prompt": "x", "response_format": "url"}, "response_format"),
             ("/v1/videos", {"prompt": "x", "size": "32x32", "num_frames": 1001}, "num_frames"),
             ("/v1/videos", {"prompt": "x", "size": "32x32", "num_frames": 4}, "num_frames"),
             ("/v1/videos", {"prompt": "x", "size": "32x31"}, "size")]
    for route, body, param in cases:
        r = httpx.post(srv.url + route, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert httpx.get(srv.url + "/v1/videos/video_nope").status_code == 404
    # Cosmos 3 makes images from text only: the edit route names it and the route
    edit = httpx.post(srv.url + "/v1/images/edits", data={"prompt": "x"},
                      files=[("image", ("a.png", _png(), "image/png"))])
    assert edit.status_code == 400 and edit.json()["error"]["param"] == "model", edit.text
    assert "tiny-cosmos3" in edit.json()["error"]["message"] and "/v1/images/edits" in edit.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    # a prompt past the pool's 1024 rows is the conductor's refusal, after the job started
    r = httpx.post(srv.url + "/v1/videos", json={"prompt": "fox " * 1100, "size": "32x32", "num_frames": 5,
                                                 "num_inference_steps": 1}, timeout=30)
    assert r.status_code == 200, r.text
    import openai

    job = _wait(openai.OpenAI(base_url=srv.url + "/v1", api_key="x"), r.json()["id"])
    assert job.status == "failed" and job.error is not None and "KV pages" in job.error.message, job
    assert httpx.get(f"{srv.url}/v1/videos/{job.id}/content").status_code == 409
    # a job deleted while it may still run: gone, its pages freed (assert_clean below)
    r = httpx.post(srv.url + "/v1/videos", json={**VIDEO, "num_inference_steps": STEPS})
    video_id = r.json()["id"]
    r = httpx.delete(f"{srv.url}/v1/videos/{video_id}")
    assert r.status_code == 200 and r.json() == {"id": video_id, "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{srv.url}/v1/videos/{video_id}").status_code == 404
    steps = srv.metric("mstar_denoise_steps_total")
    assert steps >= STEPS * 9, steps  # the images, the video and the warm-up's step
    assert_clean(srv)
