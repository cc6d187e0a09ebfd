"""Measure one server at several concurrencies, the way every mode does."""

from __future__ import annotations

import asyncio
import sys

from tqdm import tqdm

from bench.client import Backend, RequestSpec, make_prompts, run_load
from bench.server import MemorySampler, Server
from bench.stats import summarize


def num_requests(concurrency: int, requested: int | None, per_slot: int = 4, least: int = 8) -> int:
    return requested if requested else max(least, per_slot * concurrency)


def measure_levels(name: str, url: str, backend: Backend, prompts_for, concurrencies: list[int], *,
                   server: Server | None = None, warmup: int = 2, timeout: float = 600.0, client: str = "raw") -> dict:
    """Run each concurrency level in turn on one server: `prompts_for(c)` gives its
    requests. With `server`, its memory is read when idle and its peak sampled under load."""
    out: dict = {"url": url, "backend": type(backend).__name__, "client": client, "levels": []}
    if server is not None:
        out["startup_s"] = server.startup_s
        out["memory_idle"] = _mem_brief(server.memory())
        sampler = MemorySampler(server.proc.pid)
        sampler.start()
    if warmup:
        warm = prompts_for(warmup)[:warmup]
        asyncio.run(run_load(url, backend, warm, warmup, timeout=timeout, client=client))
    for c in concurrencies:
        reqs: list[RequestSpec] = prompts_for(c)
        with tqdm(total=len(reqs), desc=f"{name} c{c}", unit="req", file=sys.stderr, leave=False) as bar:
            results, wall, cpu = asyncio.run(run_load(url, backend, reqs, c, timeout=timeout, progress=bar,
                                                      client=client))
        s = summarize(results, wall, cpu, c)
        out["levels"].append(s)
        if s["num_errors"]:
            print(f"{name} c{c}: {s['num_errors']} errors, e.g. {s['errors'][:2]}", file=sys.stderr)
    if server is not None:
        out["memory_peak"] = sampler.stop()
        out["memory_after"] = _mem_brief(server.memory())
    return out


def _mem_brief(m: dict) -> dict:
    return {"processes": m["processes"], "rss_mib": round(m["rss_mib"], 1), "pss_mib": round(m["pss_mib"], 1),
            "per_process": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in p.items()}
                            for p in m["per_process"]]}


def prompt_maker(args, seed_offset: int = 0):
    """The requests for a level: seeded by the level, so every system gets the same ids."""

    def make(c: int) -> list[RequestSpec]:
        n = num_requests(c, args.num_requests)
        return make_prompts(n, args.prompt_len, args.output_len, seed=args.seed + 1000 * c + seed_offset,
                            random_ratio=args.random_ratio, id_range=tuple(args.id_range))

    return make
