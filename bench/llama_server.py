"""`python -m bench.llama_server`: mstar and llama.cpp's llama-server side by side on the
same GGUF file (the default model, SmolLM2-135M-Instruct Q4_1), same client, one run
(issue 19: weights as they come, at llama.cpp's speed).

llama-server runs from ../shared/peers/serve-llama-server (16 slots, 1,024 tokens of
context each, its default threads: every core); its binary is found with --llama-bin,
$LLAMA_SERVER_BIN, or the peer build's place. mstar runs `mstar serve` with its defaults
(the GGUF kept quantized) plus --serve-arg flags. Per system and round: start-up (launch
to ready), c1 TTFT and ITL medians, c16 output tok/s, total RSS / PSS of the process tree
(peak over the run), and greedy agreement: the share of a fixed prompt set whose 32
greedy tokens are the same text on both, and the mean length (in characters) of the common
prefix. Rounds alternate which system goes first; ratios mstar / llama-server are given per
round with their spread, against the goals: c1 ITL <= 1.0x (taken as the c1 time per
output token after the first, TPOT: llama-server's chunks often arrive bunched, so its
gap median reads 0), c16 tok/s >= 2.0x, RSS <= 1.0x, start-up <= 3 s.

    python -m bench.llama_server --rounds 3
    python -m bench.llama_server --long        # long prompts (bench/long_prompts.py)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path

import httpx

from bench import bandwidth, long_prompts
from bench.client import Backend, OpenAIBackend, make_prompts, run_load
from bench.report import machine, results_dir, table, write_json
from bench.server import PEERS, MemorySampler, MstarServer, Server, free_port
from bench.stats import ratio

DEFAULT_BIN = Path.home() / ".cache/mstar-peers/llama.cpp/src/vendor/llama.cpp/build/bin/llama-server"

#: the fixed prompt set for greedy agreement (plain text completions)
GREEDY_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "In 1492, Christopher Columbus",
    "A recipe for pancakes: first,",
    "The theory of relativity states that",
    "import numpy as np\n",
    "My favourite book is",
    "The quick brown fox",
)


class LlamaServer(Server):
    kind = "llama-server"
    ready_path = "/health"

    def __init__(self, binary: str, model: str, log_path: Path, extra: list[str] = ()) -> None:
        port = free_port()
        super().__init__([str(PEERS / "serve-llama-server"), binary, model, str(port), *extra], port, log_path)

    def _model_name(self, client: httpx.Client) -> str:
        return client.get("/v1/models").json()["data"][0]["id"]


def _greedy(url: str, model: str) -> list[str]:
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for prompt in GREEDY_PROMPTS:
            r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 32,
                                                "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["text"])
    return out


def _backend(server: Server) -> Backend:
    """mstar's own /generate (a delta per token), llama-server's /v1/completions (a chunk per token)."""
    return Backend() if isinstance(server, MstarServer) else OpenAIBackend(server.model)


def _level(server: Server, conc: int, n: int, args) -> dict:
    reqs = make_prompts(n, args.prompt_len, args.output_len, seed=args.seed)
    # httpx for both: llama-server closes a connection after a streamed answer, which bench's
    # raw keep-alive client reports as an error
    results, wall, _ = asyncio.run(run_load(server.url, _backend(server), reqs, conc, client="httpx"))
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    return {"conc": conc, "requests": n, "errors": len(results) - len(ok),
            "first_error": next((r.error for r in results if not r.ok), None),
            "out_tok_s": sum(r.output_tokens for r in ok) / wall,
            "ttft_ms_p50": 1000 * statistics.median(r.ttft for r in ok) if ok else float("nan"),
            # time per output token after the first, per request: what a client sees between
            # tokens even where a server's chunks arrive bunched (llama-server's SSE writes are
            # often read several to one socket read, so its gaps measure 0 and then a step)
            "tpot_ms_p50": 1000 * statistics.median((r.end - r.start - r.ttft) / max(1, r.output_tokens - 1)
                                                    for r in ok) if ok else float("nan"),
            "itl_ms_p50": 1000 * statistics.median(itls) if itls else float("nan")}


def measure(server: Server, args) -> dict:
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        server.model = c.get("/v1/models").json()["data"][0]["id"]
    sampler = MemorySampler(server.proc.pid, 0.5)
    sampler.start()
    try:
        out = {"startup_s": server.startup_s, "idle": server.memory()}
        asyncio.run(run_load(server.url, _backend(server), make_prompts(2, 16, 4, seed=99), 1, client="httpx"))
        if args.long:
            out["long"] = long_prompts.measure(server.url, _backend(server), args.seed + args.round)
        else:
            out["c1"] = _level(server, 1, args.c1_requests, args)
            out["c16"] = _level(server, 16, args.c16_requests, args)
            out["greedy"] = _greedy(server.url, server.model)
        out["after"] = server.memory()
    finally:
        out_mem = sampler.stop()
        server.stop()
    out.update(out_mem)
    return out


def _ratios(m: dict, ll: dict) -> dict:
    same = [a == b for a, b in zip(m["greedy"], ll["greedy"])]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(m["greedy"], ll["greedy"])]
    return {"c1_tpot": ratio(m["c1"]["tpot_ms_p50"], ll["c1"]["tpot_ms_p50"]),
            "c1_itl": ratio(m["c1"]["itl_ms_p50"], ll["c1"]["itl_ms_p50"]),
            "c1_ttft": ratio(m["c1"]["ttft_ms_p50"], ll["c1"]["ttft_ms_p50"]),
            "c16_tok_s": ratio(m["c16"]["out_tok_s"], ll["c16"]["out_tok_s"]),
            "rss": ratio(m["peak_rss_mib"], ll["peak_rss_mib"]), "startup_s": m["startup_s"],
            "greedy_same": sum(same) / len(same), "greedy_prefix_chars": statistics.mean(prefix)}


HEADER = ["system", "round", "start-up s", "c1 TTFT ms", "c1 TPOT ms", "c1 ITL p50 ms", "c16 tok/s", "peak RSS MiB",
          "peak PSS MiB", "errors"]


def _rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for r in runs:
        for name in ("mstar", "llama-server"):
            x = r[name]
            rows.append([name, str(r["round"]), f"{x['startup_s']:.2f}", f"{x['c1']['ttft_ms_p50']:.1f}",
                         f"{x['c1']['tpot_ms_p50']:.2f}", f"{x['c1']['itl_ms_p50']:.2f}",
                         f"{x['c16']['out_tok_s']:.1f}",
                         f"{x['peak_rss_mib']:.0f}", f"{x['peak_pss_mib']:.0f}",
                         str(x["c1"]["errors"] + x["c16"]["errors"])])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="", help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--llama-bin", default=os.environ.get("LLAMA_SERVER_BIN", str(DEFAULT_BIN)))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--c1-requests", type=int, default=6)
    p.add_argument("--c16-requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server flag (repeat; e.g. -t=1)")
    p.add_argument("--long", action="store_true", help="the long-prompt figures (bench/long_prompts.py)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from shared.gguf_source import find_default_gguf

    model = args.model or str(find_default_gguf())
    out_dir = results_dir(args.out)
    mem = bandwidth.floor(model)  # before the servers start: the machine quiet
    print(f"decode floor: {mem['weights_mb']:.1f} MB of weights at {mem['bandwidth_gb_s']:.1f} GB/s = "
          f"{mem['tpot_floor_ms']:.2f} ms a token", flush=True)
    runs = []
    llama_args = (long_prompts.LLAMA_ARGS if args.long else []) + args.llama_arg
    ratios, header, rows = ((long_prompts.ratios, long_prompts.HEADER, long_prompts.rows) if args.long
                            else (_ratios, HEADER, _rows))
    for rnd in range(args.rounds):
        args.round = rnd
        systems = {"mstar": lambda r=rnd: MstarServer(model, out_dir / f"mstar-{r}.log", args.serve_arg),
                   "llama-server": lambda r=rnd: LlamaServer(args.llama_bin, model, out_dir / f"llama-{r}.log",
                                                             llama_args)}
        order = list(systems) if rnd % 2 == 0 else list(systems)[::-1]
        run = {"round": rnd, "first": order[0]}
        for name in order:
            run[name] = measure(systems[name](), args)
            print(name, rnd, {k: v for k, v in run[name].items() if k != "greedy"}, flush=True)
        run["ratios"] = ratios(run["mstar"], run["llama-server"])
        print("ratios", run["ratios"], flush=True)
        runs.append(run)
    print(table(header, rows(runs)))
    summary = {}
    for key in runs[0]["ratios"]:
        vals = [v for r in runs if (v := r["ratios"][key]) == v] or [float("nan")]  # nan: not measured
        summary[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    print("mstar / llama-server per round (median [min, max]):")
    for key, v in summary.items():
        print(f"  {key}: {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]")
    for name in ("mstar", "llama-server"):
        short = [r[name]["long"]["tpot_128_ms"] if args.long else r[name]["c1"]["tpot_ms_p50"] for r in runs]
        print(f"{name} c1 TPOT at short context / the decode floor ({mem['tpot_floor_ms']:.2f} ms): "
              f"{statistics.median(short) / mem['tpot_floor_ms']:.2f}x")
    write_json(out_dir / "results.json", {"machine": machine(), "args": vars(args), "decode_floor": mem, "runs": runs,
                                          "summary": summary})
    if args.long:  # the table, JSON and PNG of each figure, mstar better by (median, range)
        long_prompts.report(out_dir / "long", runs, "llama-server", "long prompts, SmolLM2-135M Q4_1",
                            {"decode_floor": mem})
    print("load average at the end:", os.getloadavg())
    print("results in", out_dir)


if __name__ == "__main__":
    main()
