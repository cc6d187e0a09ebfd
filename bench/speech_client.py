"""One streamed `/v1/audio/speech` request timed as a client hears it, for both speech
benches (bench/speech.py's Orpheus mode and bench/speech_csm.py's CSM mode)."""

from __future__ import annotations

import time

import httpx

TEXT = "The quick brown fox jumps over the lazy dog, and the dog does not mind at all."
GREEDY = {"temperature": 0, "top_p": 1.0, "repetition_penalty": 1.0}


async def mstar_one(client: httpx.AsyncClient, max_tokens: int,
                    sampling: dict | None = None) -> tuple[float, float, int]:
    """(TTFA s, wall s, audio bytes as pcm16) of one streamed request."""
    t0 = time.perf_counter()
    first, size = 0.0, 0
    body = {"input": TEXT, "response_format": "pcm", "stream_format": "audio", "max_tokens": max_tokens,
            **(GREEDY if sampling is None else sampling)}
    async with client.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        async for chunk in r.aiter_bytes():
            if chunk and not first:
                first = time.perf_counter()
            size += len(chunk)
    return first - t0, time.perf_counter() - t0, size
