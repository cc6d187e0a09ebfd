"""BAGEL in bfloat16 (`--dtype bfloat16`) against its reference in bfloat16, text to image and
understanding (a text-only turn and an image's; greedy tokens equal, logprobs within
LOGPROB_TOLERANCE):
ByteDance's `InterleaveInferencer` (bagel2 0.0.6) on the same tiny random folder
(tests/bagel_checkpoints.py), its `Bagel` cast to bfloat16 (its FLUX autoencoder float32, as
its app loads it) and run under `torch.autocast(bfloat16)`, as its app runs it (CUDA's
autocast there; the CPU's here, the reference's attention in bfloat16 as its flash-attn casts).

Tolerance: the PNG within TOLERANCE of the reference's (uint8 max abs diff), the mean within
MEAN_TOLERANCE. The two compute the same ops in bfloat16 but not in the same order nor with
the same casts (mstar casts where autocast would, without autocast; its attention is its own
paged kernel, the reference's SDPA over flash-attn's layout; its autoencoder runs in bfloat16,
the reference's under autocast), so each op's bf16 rounding (8 bits of mantissa, ~0.4 %)
differs and the flow-matching steps carry it on. Measured (this folder, BODY): max 6, mean
0.91 (the float32 reference vs the bf16 one: max 4, mean 0.61; the bf16 reference for seed 8
vs seed 7: max 226, mean 39, so the bound tells images apart). The bound leaves ~1.6x margin.
The reference's autocast here is the CPU's (its app's is CUDA's, whose op lists differ a
little: e.g. CUDA keeps group_norm in float32); no GPU check was run.
"""

from __future__ import annotations

import asyncio
import base64
import io
from functools import cache
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.bagel_checkpoints import _float32_attention, build_reference, make_bagel_checkpoint, reference_chat
from tests.e2e.test_bagel import IMAGES, MAX_TOKENS, prompt, url
from tests.servers import MstarServer, assert_clean

#: uint8 pixels: max and mean abs diff allowed against the bf16 reference
TOLERANCE = 10
MEAN_TOLERANCE = 1.5
#: understanding's log-probabilities: the reference's logits are bf16 (its lm_head under
#: autocast), one ulp 1/64 for |logit| in [2, 4); measured max 0.016 (a ulp): ~3 ulp
LOGPROB_TOLERANCE = 0.05
#: guidance on (three branches), a non-square size
BODY = {"prompt": "A red cat on a mat.", "size": "48x32", "num_inference_steps": 4, "guidance_scale": 3.0,
        "seed": 7}


#: understanding: the inferencer's input lists (an image: its ViT rows in bf16 too)
CASES = {"text only": ("What is in the picture?",), "image then text": ("red", "What is in the picture?")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_bagel_checkpoint(tmp_path_factory.mktemp("bagel-bf16") / "BAGEL-7B-MoT")


@cache
def _reference(folder: Path) -> dict:
    return build_reference(folder, dtype="bfloat16")


def reference_answer(folder: Path, items: tuple[str, ...]) -> tuple[list[int], list[float]]:
    """The bf16 reference's greedy answer (under autocast: `reference_chat`) and its logprobs."""
    from PIL import Image

    inputs = [Image.open(io.BytesIO(IMAGES[x])) if x in IMAGES else x for x in items]
    try:
        return reference_chat(_reference(folder), inputs, MAX_TOKENS)
    finally:
        _float32_attention()


def reference_image(folder: Path) -> np.ndarray:
    """The inferencer's image for BODY in bfloat16 under autocast, on the global generator
    seeded with BODY's seed."""
    import torch
    from bagel2.inferencer import InterleaveInferencer

    ref = _reference(folder)
    inf = InterleaveInferencer(ref["model"], ref["vae"], ref["tokenizer"], ref["vae_transform"],
                               ref["vit_transform"], ref["ids"])
    width, height = (int(s) for s in BODY["size"].split("x"))
    torch.manual_seed(BODY["seed"])
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            image = inf.interleave_inference([BODY["prompt"]], image_shapes=(height, width),
                                             num_timesteps=BODY["num_inference_steps"],
                                             cfg_text_scale=BODY["guidance_scale"])[-1]
    finally:
        _float32_attention()  # a float32 reference built earlier in this process sees float32 again
    return np.asarray(image)


@pytest.fixture(scope="module")
def served(folder, tmp_path_factory):
    """(the bf16 `--task image` server, the reference's image, the bf16 understanding server,
    the reference's answers): the reference computes while the servers start."""
    log = tmp_path_factory.mktemp("logs") / "bagel-bf16.log"
    args = ("--dtype", "bfloat16", "--page-size", "16")
    srv = MstarServer(str(folder), log, "--task", "image", "--num-kv-pages", "128", *args,
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).launch()
    und = MstarServer(str(folder), log.with_name("bagel-bf16-und.log"), "--num-kv-pages", "160", *args,
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).launch()
    try:
        want = reference_image(folder)
        answers = {name: reference_answer(folder, items) for name, items in CASES.items()}
        yield srv.wait_ready(), want, und.wait_ready(), answers
    finally:
        srv.stop()
        und.stop()


async def test_bf16_image_within_tolerance_of_the_bf16_reference(served):
    """The PNG within TOLERANCE (max) and MEAN_TOLERANCE (mean) of the bf16 reference's
    image, and not a flat image (the comparison means something); pages back to zero."""
    from PIL import Image

    srv, want, _, _ = served
    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
        r = await client.post("/v1/images/generations", json=BODY)
    assert r.status_code == 200, r.text
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).convert("RGB"))
    assert got.shape == want.shape
    diff = np.abs(got.astype(int) - want.astype(int))
    print(f"bf16 vs bf16 reference: max {diff.max()} mean {diff.mean():.3f}")
    assert diff.max() <= TOLERANCE and diff.mean() <= MEAN_TOLERANCE, (diff.max(), diff.mean())
    assert want.std() > 5
    assert_clean(srv)


async def test_bf16_answers_equal_the_bf16_reference(served):
    """Greedy tokens equal the bf16 reference's; logprobs within LOGPROB_TOLERANCE."""
    _, _, und, answers = served
    async with httpx.AsyncClient(base_url=und.url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/generate", json={
            "prompt": prompt(items), "images": [url(x) for x in items if x in IMAGES], "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": 1}) for items in CASES.values()))
    for name, r in zip(CASES, replies):
        assert r.status_code == 200, r.text
        want, lps = answers[name]
        body = r.json()
        assert body["token_ids"] == want, name
        got = [t["logprob"] for t in body["logprobs"]]
        assert np.allclose(got, lps, atol=LOGPROB_TOLERANCE, rtol=0), (name, got, lps)
    assert_clean(und)
