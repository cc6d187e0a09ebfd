"""The floor for per-token serving overhead: a raw pyzmq + msgspec round trip.

Two processes, a PUSH/PULL pair each way over ipc (as mstar's services use), one small
msgspec struct (shaped like mstar's `Output`) per token:

- `round_trip`: A sends a token, B decodes it and sends the next one back, A decodes it;
  the time per token is one full hop out and back, the least any multi-process pipeline
  can spend per token when every token crosses processes.
- `stream`: B pushes tokens to A as fast as it can; the time per token is the throughput
  floor of one hop.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import msgspec
import zmq


class Token(msgspec.Struct, tag="tok", array_like=True, omit_defaults=True, gc=False):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Go(msgspec.Struct, tag="go", array_like=True, gc=False):
    n: int


Msg = Token | Go


def _peer(a_addr: str, b_addr: str) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(b_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(a_addr)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Msg)
    push.send(enc.encode(Go(0)))  # hello: A knows B is up
    while True:
        msg = dec.decode(pull.recv())
        if isinstance(msg, Go):
            if msg.n < 0:
                break
            for i in range(msg.n):  # stream mode
                push.send(enc.encode(Token("req-0", [i % 1000], None, 16, i + 1)))
            continue
        tok = msg.token_ids[0]
        push.send(enc.encode(Token(msg.request_id, [tok + 1], None, msg.prompt_tokens, msg.completion_tokens + 1)))
    push.close(0)
    pull.close(0)
    ctx.term()


def measure_floor(n: int = 20000, warmup: int = 2000) -> dict:
    """Round-trip and stream time per token (µs), measured now, in two processes."""
    run = tempfile.mkdtemp(prefix="mstar-floor-")
    a_addr, b_addr = f"ipc://{run}/a.sock", f"ipc://{run}/b.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(a_addr)
    peer = mp.get_context("spawn").Process(target=_peer, args=(a_addr, b_addr), daemon=True)
    peer.start()
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Msg)
    push = ctx.socket(zmq.PUSH)
    push.connect(b_addr)
    dec.decode(pull.recv())  # B's hello
    samples = []
    tok = Token("req-0", [0], None, 16, 0)
    for i in range(warmup + n):
        t0 = time.perf_counter()
        push.send(enc.encode(tok))
        tok = dec.decode(pull.recv())
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    push.send(enc.encode(Go(warmup)))
    for _ in range(warmup):
        dec.decode(pull.recv())
    t0 = time.perf_counter()
    push.send(enc.encode(Go(n)))
    for _ in range(n):
        dec.decode(pull.recv())
    stream_s = time.perf_counter() - t0
    push.send(enc.encode(Go(-1)))
    peer.join(10)
    push.close(0)
    pull.close(0)
    ctx.term()
    for name in ("a.sock", "b.sock"):
        try:
            os.unlink(os.path.join(run, name))
        except OSError:
            pass
    os.rmdir(run)
    samples.sort()
    us = 1e6
    return {
        "tokens": n,
        "round_trip_us": {"mean": sum(samples) / n * us, "p50": samples[n // 2] * us,
                          "p99": samples[int(n * 0.99)] * us},
        "stream_us_per_token": stream_s / n * us,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(measure_floor(), indent=2))
