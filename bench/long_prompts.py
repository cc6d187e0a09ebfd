"""The long-prompt mode of `python -m bench.llama_server --long` (issue 34): chat histories,
RAG contexts and agent transcripts are thousands of tokens, where prefill speed and
attention over a long context decide what a user waits.

Per system and round, each a fresh random prompt (no prefix-cache hit on either side):
- TTFT of one 2,048-token and one 8,000-token prompt (c1, the server otherwise idle);
- time per output token after the first (TPOT) at 128, 2,048 and 8,000 tokens of context:
  the same requests' 64 output tokens (the 128 one a request of its own);
- output tok/s of 4 clients at once, each 1,536-token prompts and 64 tokens out.

llama-server gets 4 slots of 8,192 tokens (`-np 4 -c 32768`: its default 16 slots of 1,024
cannot hold the prompts); mstar its defaults (the model's 8,192-token context).
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

from bench import side_by_side
from bench.client import Backend, RequestResult, make_prompts, run_load
from bench.side_by_side import Figure
from bench.stats import ratio

#: llama-server flags for this mode: 4 slots, each the model's whole context
LLAMA_ARGS = ["-np", "4", "-c", "32768"]
#: (name, prompt tokens) of the c1 requests; the 128 one measures TPOT at short context
C1_PROMPTS = (("2k", 2048), ("8k", 8000), ("128", 128))
OUTPUT = 64
C4_PROMPT, C4_REQUESTS = 1536, 8


def _one(url: str, backend: Backend, prompt_len: int, seed: int) -> RequestResult:
    reqs = make_prompts(1, prompt_len, OUTPUT, seed=seed, id_range=(10, 20000))
    results, _, _ = asyncio.run(run_load(url, backend, reqs, 1, client="httpx"))
    r = results[0]
    if not r.ok:
        raise RuntimeError(f"a {prompt_len}-token request failed: {r.error}")
    return r


def _tpot_ms(r: RequestResult) -> float:
    return 1000 * (r.end - r.start - r.ttft) / max(1, r.output_tokens - 1)


def measure(url: str, backend: Backend, seed: int) -> dict:
    """One system's long-prompt figures (see the module's docstring)."""
    out: dict = {}
    for i, (name, n) in enumerate(C1_PROMPTS):
        r = _one(url, backend, n, seed * 100 + i)
        out[f"ttft_{name}_ms"] = 1000 * r.ttft
        out[f"tpot_{name}_ms"] = _tpot_ms(r)
    reqs = make_prompts(C4_REQUESTS, C4_PROMPT, OUTPUT, seed=seed * 100 + 50, id_range=(10, 20000))
    results, wall, _ = asyncio.run(run_load(url, backend, reqs, 4, client="httpx"))
    ok = [r for r in results if r.ok]
    out["c4_tok_s"] = sum(r.output_tokens for r in ok) / wall
    out["c4_ttft_ms_p50"] = 1000 * statistics.median(r.ttft for r in ok) if ok else float("nan")
    out["errors"] = len(results) - len(ok)
    return out


def ratios(m: dict, ll: dict) -> dict:
    """mstar / llama-server per figure, and mstar's own TPOT growth from 128 to 2,048 tokens."""
    keys = ("ttft_2k_ms", "ttft_8k_ms", "tpot_128_ms", "tpot_2k_ms", "tpot_8k_ms", "c4_tok_s")
    r = {k: ratio(m["long"][k], ll["long"][k]) for k in keys}
    r["mstar_tpot_2k_over_128"] = ratio(m["long"]["tpot_2k_ms"], m["long"]["tpot_128_ms"])
    r["llama_tpot_2k_over_128"] = ratio(ll["long"]["tpot_2k_ms"], ll["long"]["tpot_128_ms"])
    return r


HEADER = ["system", "round", "TTFT 2k ms", "TTFT 8k ms", "TPOT 128 ms", "TPOT 2k ms", "TPOT 8k ms", "c4 tok/s",
          "peak RSS MiB", "errors"]


def rows(runs: list[dict]) -> list[list[str]]:
    out = []
    for r in runs:
        for name in ("mstar", "llama-server"):
            x = r[name]
            lg = x["long"]
            out.append([name, str(r["round"]), f"{lg['ttft_2k_ms']:.0f}", f"{lg['ttft_8k_ms']:.0f}",
                        f"{lg['tpot_128_ms']:.2f}", f"{lg['tpot_2k_ms']:.2f}", f"{lg['tpot_8k_ms']:.2f}",
                        f"{lg['c4_tok_s']:.1f}", f"{x['peak_rss_mib']:.0f}", str(lg["errors"])])
    return out


#: the figures of the side-by-side report (table, JSON, PNG)
FIGURES = [Figure("TTFT 2k (s)", "ttft_2k_ms", 1e-3), Figure("TTFT 8k (s)", "ttft_8k_ms", 1e-3),
           Figure("TPOT 128 (ms)", "tpot_128_ms"), Figure("TPOT 2k (ms)", "tpot_2k_ms"),
           Figure("TPOT 8k (ms)", "tpot_8k_ms"), Figure("c4 tok/s", "c4_tok_s", higher_is_better=True)]


def report(out: Path, runs: list[dict], reference: str, title: str, extra: dict) -> Path:
    """The side-by-side table, JSON and PNG (bench/side_by_side.py) of rounds that each hold
    {"mstar": {"long": ...}, reference: {"long": ...}}."""
    out.mkdir(parents=True, exist_ok=True)
    by_system = {name: [r[name]["long"] for r in runs] for name in ("mstar", reference)}
    return side_by_side.report(out, by_system, FIGURES, reference, title, extra)
