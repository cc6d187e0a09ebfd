"""Where a served long prompt's TTFT goes, hop by hop (issues 50 and 51).

    python -m bench.ttft_hops --model FILE.gguf [--prompt-len 896] [--requests 8] [--serve-arg=--flag ...]

Serves the model with `MSTAR_TRACE` set (shared/trace.py: every service stamps each hop of
a request on the host's monotonic clock), sends `--requests` streamed `/generate` requests of
`--prompt-len` fresh random ids one at a time (as bench.hybrid's 896-token TTFT does), and
prints each hop's median and the TTFT the client saw, so the served TTFT can be held
against `python -m bench.prefill`'s in-process prefill.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

#: the hops in the order a request passes them (shared/trace.py names), client's first and last
HOPS = ["client.send", "api.arrive", "api.accepted", "api.send", "dw.recv", "dw.prepared", "dw.send", "cond.recv",
        "cond.send", "gpu.recv", "gpu.added", "gpu.step", "gpu.send", "api.output", "api.first_event",
        "api.first_written", "client.first"]


def _request(client, prompt: list[int], rid: str) -> tuple[float, float]:
    """One streamed request: (monotonic ms when sent, when its first token came)."""
    import msgspec

    body = msgspec.json.encode({"input_ids": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                                "stream": True, "request_id": rid})
    sent = time.monotonic() * 1e3
    first = 0.0
    with client.stream("POST", "/generate", content=body, headers={"content-type": "application/json"}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not first and line.startswith("data:") and '"delta"' in line:
                first = time.monotonic() * 1e3
    return sent, first


def rows(traces: dict[str, dict[str, list[float]]]) -> list[tuple[str, float, float]]:
    """(hop pair, median ms, max ms) over the requests that passed every hop; the last row
    is the TTFT, and one row says how many steps the prompt took."""
    full = [t for t in traces.values() if all(h in t for h in HOPS)]
    out = []
    for a, b in itertools.pairwise(HOPS):
        gaps = [t[b][0] - t[a][0] for t in full]
        out.append((f"{a} -> {b}", statistics.median(gaps), max(gaps)))
    ttft = [t["client.first"][0] - t["client.send"][0] for t in full]
    out.append(("TTFT", statistics.median(ttft), max(ttft)))
    steps = [sum(1 for x in t["gpu.step"] if x < t["gpu.send"][0]) for t in full]
    out.append(("prefill steps", statistics.median(steps), max(steps)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ttft_hops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=896)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    args = ap.parse_args(argv)
    import httpx

    from bench.server import MstarServer
    from shared import trace

    folder = tempfile.mkdtemp(prefix="mstar-trace-")
    server = MstarServer(args.model, Path(folder) / "server.log", args.serve_arg, env={"MSTAR_TRACE": folder})
    server.start()
    rng, client_times = random.Random(0), {}
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            _request(client, [rng.randrange(10, 20000) for _ in range(16)], "warm")
            for i in range(args.requests):
                rid = f"hop-{i}"
                client_times[rid] = _request(client, [rng.randrange(10, 20000) for _ in range(args.prompt_len)], rid)
    finally:
        server.stop()
    traces = trace.read(folder)
    for rid, (sent, first) in client_times.items():
        traces.setdefault(rid, {}).update({"client.send": [sent], "client.first": [first]})
    traces.pop("warm", None)
    for name, median, worst in rows(traces):
        print(f"{name:34s} {median:8.2f} {worst:8.2f}")
    print("load average:", os.getloadavg())
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
