"""The load generator: a closed loop of `concurrency` streaming HTTP clients.

Each client takes the next prompt, streams it (SSE) and records when every token arrived:
`/generate` with `input_ids` for mstar, `/v1/completions` with a token-id prompt for an
OpenAI-compatible peer (vLLM). Greedy, `ignore_eos`, so every request makes exactly its
`max_tokens`.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import msgspec

_json = msgspec.json.Decoder()


@dataclass
class RequestSpec:
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    start: float = 0.0  # perf_counter at send
    token_times: list[float] = field(default_factory=list)  # perf_counter of each token's arrival
    end: float = 0.0
    output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


def make_prompts(n: int, prompt_len: int, output_len: int, *, seed: int = 0, random_ratio: float = 0.0,
                 id_range: tuple[int, int] = (10, 250)) -> list[RequestSpec]:
    """`n` prompts of random token ids in `id_range`. With `random_ratio` r > 0 the prompt
    and output lengths are uniform in [len * (1 - r), len] (vLLM's `--random-range-ratio`)."""
    rng = random.Random(seed)
    lo, hi = id_range
    out = []
    for _ in range(n):
        p = prompt_len if random_ratio <= 0 else rng.randint(max(1, int(prompt_len * (1 - random_ratio))), prompt_len)
        o = output_len if random_ratio <= 0 else rng.randint(max(1, int(output_len * (1 - random_ratio))), output_len)
        out.append(RequestSpec([rng.randrange(lo, hi) for _ in range(p)], o))
    return out


class Backend:
    """How to ask one server for a streamed, greedy completion of token ids."""

    path = "/generate"
    #: every request must return exactly max_tokens (ignore_eos); False where the reply ends itself
    exact_length = True

    def __init__(self, model: str = "") -> None:
        self.model = model

    def body(self, req: RequestSpec) -> dict:
        return {"input_ids": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True}

    def parse(self, event: dict, res: RequestResult, now: float) -> bool:
        """Record one SSE event; True when the request is over."""
        kind = event.get("type")
        if kind == "delta":
            ids = event.get("token_ids") or []
            res.token_times.extend([now] * len(ids))
            res.token_ids.extend(ids)
            return False
        if kind == "done":
            res.output_tokens = int(event.get("usage", {}).get("completion_tokens", len(res.token_ids)))
            return True
        if kind == "error":
            res.error = str(event.get("error"))
            return True
        return False


class OpenAIBackend(Backend):
    """`/v1/completions` with a token-id prompt (vLLM, or any server taking one)."""

    path = "/v1/completions"

    def body(self, req: RequestSpec) -> dict:
        return {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def parse(self, event: dict, res: RequestResult, now: float) -> bool:
        if "error" in event and "choices" not in event:
            res.error = str(event["error"])
            return True
        for ch in event.get("choices") or []:
            # One chunk per engine step and request: one token without speculation. The usage
            # at the end gives the true count (chunk times are spread over it if it differs).
            if ch.get("text") or not ch.get("finish_reason"):
                res.token_times.append(now)
        usage = event.get("usage")
        if usage:
            res.output_tokens = int(usage.get("completion_tokens", len(res.token_times)))
        return False


def _spread(res: RequestResult) -> None:
    """Make token_times one entry per output token when the chunk count differs (a chunk
    carried several tokens, or a token produced no text): later chunks get the extras."""
    n, t = res.output_tokens, res.token_times
    if not t or n == len(t) or n <= 0:
        return
    res.token_times = t[:n] if n < len(t) else t + [t[-1]] * (n - len(t))


class HttpError(Exception):
    pass


class RawConnection:
    """A minimal HTTP/1.1 client for one keep-alive connection: POST a JSON body, yield
    the `data:` payloads of the SSE reply as they arrive (chunked or not). It takes about
    half httpx's CPU per token from the cores the server shares with it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.reader = self.writer = None

    async def events(self, path: str, body: bytes):
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        reader = self.reader
        status_line = await reader.readline()
        if not status_line:
            await self.close()
            raise HttpError("connection closed by the server")
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        keep = headers.get("connection", "").lower() != "close"
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        length = int(headers["content-length"]) if "content-length" in headers else None
        if status != 200:
            data = await reader.readexactly(length) if length is not None else await self._read_chunked_all()
            await self.close()
            raise HttpError(f"HTTP {status}: {data[:300]!r}")
        buf = b""
        if chunked:
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                buf += await reader.readexactly(size + 2)
                buf = buf[:-2] if buf.endswith(b"\r\n") else buf
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            yield line[5:].strip()
        else:
            data = await (reader.readexactly(length) if length is not None else reader.read())
            keep = keep and length is not None
            for line in data.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()
        if not keep:
            await self.close()

    async def _read_chunked_all(self) -> bytes:
        out = b""
        while True:
            size = int((await self.reader.readline()).split(b";")[0], 16)
            if size == 0:
                await self.reader.readline()
                return out
            out += (await self.reader.readexactly(size + 2))[:-2]


async def _httpx_events(client: httpx.AsyncClient, path: str, body: bytes, timeout: float):
    async with client.stream("POST", path, content=body, headers={"content-type": "application/json"},
                             timeout=timeout) as resp:
        if resp.status_code != 200:
            raise HttpError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                yield line[5:].strip().encode()


async def _one(events, backend: Backend, req: RequestSpec) -> RequestResult:
    """One request over `events(path, body)`, an async iterator of SSE data payloads."""
    res = RequestResult(len(req.prompt), req.max_tokens)
    body = msgspec.json.encode(backend.body(req))
    res.start = time.perf_counter()
    try:
        done = False
        async for data in events(backend.path, body):
            if data == b"[DONE]":
                done = True
                continue
            if not done and backend.parse(_json.decode(data), res, time.perf_counter()):
                done = True  # read the stream to its end all the same (keep-alive)
        if not done and res.error is None:
            res.error = "stream ended without a done event"
    except (httpx.HTTPError, HttpError, OSError, asyncio.IncompleteReadError, msgspec.DecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.end = time.perf_counter()
    if isinstance(backend, OpenAIBackend) and not res.output_tokens:
        res.output_tokens = len(res.token_times)
    _spread(res)
    if res.error is None and backend.exact_length and res.output_tokens != req.max_tokens:
        res.error = f"got {res.output_tokens} tokens, asked for {req.max_tokens} (ignore_eos)"
    return res


async def run_load(url: str, backend: Backend, requests: list[RequestSpec], concurrency: int, *,
                   timeout: float = 600.0, progress=None,
                   client: str = "raw") -> tuple[list[RequestResult], float, float]:
    """Run every request, at most `concurrency` in flight (a closed loop; each slot keeps
    one connection). `client`: "raw" (bench's own HTTP/1.1 client) or "httpx". Returns the
    results in request order, the wall time from the first send to the last token, and
    this client process's CPU seconds over the run."""
    results: list[RequestResult | None] = [None] * len(requests)
    queue = list(enumerate(requests))[::-1]
    parsed = urlsplit(url)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as hx:

        async def worker() -> None:
            conn = RawConnection(parsed.hostname or "127.0.0.1", parsed.port or 80)
            if client == "raw":
                events = conn.events
            else:
                def events(path, body):
                    return _httpx_events(hx, path, body, timeout)
            try:
                while queue:
                    i, req = queue.pop()
                    try:
                        results[i] = await asyncio.wait_for(_one(events, backend, req), timeout)
                    except TimeoutError:
                        results[i] = RequestResult(len(req.prompt), req.max_tokens, error=f"timed out after {timeout}s")
                        await conn.close()
                    if progress is not None:
                        progress.update(1)
            finally:
                await conn.close()

        cpu0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    return [r for r in results if r is not None], wall, cpu
