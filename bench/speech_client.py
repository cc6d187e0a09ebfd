"""One streamed speech request timed as a client hears it, for the speech benches
(bench/speech.py's Orpheus mode, bench/speech_csm.py's CSM mode, bench/speech_families.py):
`/v1/audio/speech`, or a Qwen3-Omni chat turn with `modalities: ["text", "audio"]`."""

from __future__ import annotations

import base64
import json
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


async def omni_one(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    """A streamed Qwen3-Omni chat turn speaking its text (greedy, `max_tokens` text tokens,
    EOS ignored): {"ttfa": the first `delta.audio`, "text_s": the last `delta.content`,
    "wall", "audio_s"} (seconds from the request)."""
    t0 = time.perf_counter()
    first, text_done, samples = 0.0, 0.0, 0
    body = {"messages": messages, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content"):
                    text_done = time.perf_counter()
                if delta.get("audio"):
                    first = first or time.perf_counter()
                    samples += len(base64.b64decode(delta["audio"]["data"])) // 2
    return {"ttfa": first - t0, "text_s": text_done - t0, "wall": time.perf_counter() - t0, "audio_s": samples / 24000}
