"""Continuous batching changes nothing: 8 concurrent greedy requests of different lengths
produce the same tokens as each alone."""

from __future__ import annotations

import asyncio

import httpx

PROMPTS = [("Hello world! " * n).strip() for n in (1, 3, 5, 8, 11, 2, 17, 25)]


async def _generate(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> list[int]:
    r = await client.post("/generate", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


async def test_batched_equals_unbatched(llama_server):
    async with httpx.AsyncClient(base_url=llama_server.url, timeout=120) as client:
        alone = [await _generate(client, p, 6 + i) for i, p in enumerate(PROMPTS)]
        together = await asyncio.gather(*(_generate(client, p, 6 + i) for i, p in enumerate(PROMPTS)))
    assert list(together) == alone
    assert [len(t) for t in alone] == [6 + i for i in range(8)]
