"""A row's result does not depend on which rows share its step or how its prompt was cut
(issue 56): on the default model (its quantized GGUF weights on this host's kernel path),
the same greedy request with logprobs gives bitwise the same tokens and logprobs alone and
among 15 concurrent streams of other prompts, with the other core kept busy so the
time-budgeted chunking cuts prompts differently than it would on an idle machine."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import httpx
import pytest

pytestmark = pytest.mark.kernels  # also run on the AVX2 build (scripts/test)

PROBE = {"prompt": "<|im_start|>user\nName three rivers in Europe and say where each one flows.<|im_end|>\n"
                   "<|im_start|>assistant\n", "max_tokens": 24, "temperature": 0, "logprobs": 2,
         "ignore_eos": True}


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def _probe(client: httpx.AsyncClient) -> tuple[list[int], list]:
    r = await client.post("/generate", json=PROBE)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["token_ids"], body["logprobs"]


async def _stream(client: httpx.AsyncClient, i: int) -> None:
    prompt = f"<|im_start|>user\nWrite a long story about the number {i} and a lighthouse.<|im_end|>\n" * (1 + i % 4)
    r = await client.post("/generate", json={"prompt": prompt, "max_tokens": 40 + i, "temperature": 0.7,
                                             "seed": i, "ignore_eos": True})
    assert r.status_code == 200, r.text


async def _together(client: httpx.AsyncClient, delay: float) -> tuple[list[int], list]:
    others = [asyncio.create_task(_stream(client, i)) for i in range(15)]
    await asyncio.sleep(delay)  # the probe joins steps already full of other rows
    got = await _probe(client)
    await asyncio.gather(*others)
    return got


async def test_greedy_logprobs_alone_and_among_15_streams_under_load(smollm_server):
    burner = multiprocessing.get_context("spawn").Process(target=_burn, args=(120.0,), daemon=True)
    burner.start()
    try:
        async with httpx.AsyncClient(base_url=smollm_server.url, timeout=300) as client:
            alone = await _probe(client)
            for delay in (0.0, 0.3, 1.0):
                assert await _together(client, delay) == alone, f"the probe differs among streams (delay {delay})"
            assert await _probe(client) == alone
    finally:
        burner.terminate()
        burner.join()


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_windowed_prompt_is_the_same_whole_and_cut(family, tmp_path):
    """Under a sliding window (8 rows, pages of 8) a 90-token prompt's prompt logprobs, tokens
    and logprobs are bitwise the same prefilled whole and in 16-row chunks: the C prefill
    kernel's key blocks sit at absolute rows (`key_base`), so a row does not depend on how
    many pages behind the window its chunk's start had released (they differed in the last
    bits before)."""
    from tests.checkpoints import make_checkpoint
    from tests.servers import MstarServer

    folder = make_checkpoint(tmp_path / "ckpt", family)
    ids = [5 + (i * 7) % 200 for i in range(90)]
    got = {}
    for name, cut in (("whole", ()), ("chunked", ("--max-batch-tokens", "16"))):
        srv = MstarServer(str(folder), tmp_path / f"{name}.log", "--num-kv-pages", "64", "--page-size", "8",
                          "--no-prefix-cache", *cut).start()
        try:
            r = httpx.post(srv.url + "/generate", timeout=120, json={
                "input_ids": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                "prompt_logprobs": 0})
            assert r.status_code == 200, r.text
            got[name] = r.json()
        finally:
            srv.stop()
    for field in ("token_ids", "logprobs", "prompt_logprobs"):
        assert got["whole"][field] == got["chunked"][field], field
