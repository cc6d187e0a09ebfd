"""`python -m bench structured`: what a JSON schema costs per output token (issue 30).

One server (the embedded SmolLM2-135M-Instruct by default), the same chat prompts asked for
JSON, in alternating rounds: free (ignore_eos, as many tokens as the constrained replies
average) and constrained by a JSON schema (`response_format` on `/generate`), at each
concurrency. The figure is the ratio of the time per output token (TPOT p50), constrained /
free, with its spread over the rounds (goal: at most 1.10x). Beside it, the mask's own cost:
`Guide.allowed()` timed over the tokens of real constrained replies, in this process, on the
model's own tokenizer (the per-row work the sampler adds to a step).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.client import Backend, RequestResult, RequestSpec, run_load
from bench.report import finish_tpot_bars, machine, results_dir, table, write_json
from bench.server import MstarServer
from bench.stats import summarize

SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                       "city": {"type": "string", "maxLength": 24}, "likes": {"type": "array", "maxItems": 3,
                                                                            "items": {"type": "string",
                                                                                      "maxLength": 16}}},
        "required": ["name", "age", "city", "likes"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
TOPICS = ["a small town", "a football team", "a school class", "a jazz band", "a hospital ward", "a ship's crew",
          "a cooking club", "a chess tournament"]


def prompts(n: int) -> list[str]:
    return [f"<|im_start|>user\nInvent six people from {TOPICS[i % len(TOPICS)]} and describe each one as JSON "
            "with name, age, city and likes.<|im_end|>\n<|im_start|>assistant\n" for i in range(n)]


class SchemaBackend(Backend):
    """/generate with the schema as `response_format`, greedy, ending at the grammar's end."""

    exact_length = False

    def body(self, req: RequestSpec) -> dict:
        return {"input_ids": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}}


def _tpot(results: list[RequestResult], wall: float, cpu: float, c: int) -> dict:
    s = summarize(results, wall, cpu, c)
    return {"tpot_p50_ms": s["tpot_ms"]["p50"], "tok_s": s["output_throughput"], "tokens": s["output_tokens"],
            "errors": s["num_errors"]}


def mask_cost(model: str, replies: list[list[int]]) -> dict:
    """µs per `Guide.allowed()` over the tokens of constrained replies (and per accept)."""
    from services.api.schemas import ConstrainedFields
    from services.api.structured import parse_structured
    from services.api.validation import load
    from services.gpu_worker.guided import Guides
    from shared.model_source import ModelSource

    source = ModelSource(model)
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}}
    grammar = parse_structured(load(body, ConstrainedFields))
    guides = Guides(lambda: source.tokenizer.tokenizer.to_str(), source.tokenizer.tokenizer.get_vocab_size(),
                    source.eos_token_ids)
    t0 = time.perf_counter()
    guides.tokenizer()
    build_s = time.perf_counter() - t0
    masks, accepts = [], []
    for ids in replies:
        g = guides.new(grammar)
        for t in ids:
            t1 = time.perf_counter()
            g.allowed()
            t2 = time.perf_counter()
            g.accept(t)
            masks.append(t2 - t1)
            accepts.append(time.perf_counter() - t2)
    masks.sort()
    return {"tokenizer_build_s": build_s, "rows": len(masks), "mask_us_p50": masks[len(masks) // 2] * 1e6,
            "mask_us_p99": masks[int(len(masks) * 0.99)] * 1e6, "accept_us_p50": statistics.median(accepts) * 1e6}


def structured(args) -> Path:
    out = results_dir(args.out)
    from shared.model_source import ModelSource

    tok = ModelSource(args.model).tokenizer.tokenizer
    specs = [RequestSpec(tok.encode(t, add_special_tokens=False).ids, args.max_tokens)
             for t in prompts(args.num_requests)]
    print("starting mstar serve ...", file=sys.stderr)
    server = MstarServer(args.model, out / "logs" / "mstar.log", args.serve_arg).start()
    runs: dict[str, list[dict]] = {}
    replies: list[list[int]] = []
    try:
        asyncio.run(run_load(server.url, SchemaBackend(), specs[:1], 1, timeout=args.timeout))  # grammar warm-up
        for r in range(args.rounds):
            for c in args.concurrency:
                res, wall, cpu = asyncio.run(run_load(server.url, SchemaBackend(), specs, c, timeout=args.timeout))
                bad = [x for x in res if x.ok and not _parses(tok.decode(x.token_ids))]
                runs.setdefault(f"schema c{c}", []).append({**_tpot(res, wall, cpu, c), "unparsed": len(bad)})
                replies += [x.token_ids for x in res if x.ok][:4] if r == 0 else []
                mean_len = max(2, round(sum(x.output_tokens for x in res) / max(1, len(res))))
                free = [RequestSpec(s.prompt, mean_len) for s in specs]
                res, wall, cpu = asyncio.run(run_load(server.url, Backend(), free, c, timeout=args.timeout))
                runs.setdefault(f"free c{c}", []).append(_tpot(res, wall, cpu, c))
                print(f"round {r + 1} c{c}: schema {runs[f'schema c{c}'][-1]['tpot_p50_ms']:.2f} ms, "
                      f"free {runs[f'free c{c}'][-1]['tpot_p50_ms']:.2f} ms", file=sys.stderr)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    cost = mask_cost(args.model, replies)
    rows, ratios = [], {}
    for c in args.concurrency:
        pairs = [s["tpot_p50_ms"] / f["tpot_p50_ms"] for s, f in zip(runs[f"schema c{c}"], runs[f"free c{c}"])]
        ratios[f"c{c}"] = {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs)}
        s_med = statistics.median(x["tpot_p50_ms"] for x in runs[f"schema c{c}"])
        f_med = statistics.median(x["tpot_p50_ms"] for x in runs[f"free c{c}"])
        rows.append([f"c{c}", f"{f_med:.2f}", f"{s_med:.2f}",
                     f"{ratios[f'c{c}']['median']:.3f}x ({ratios[f'c{c}']['min']:.3f}-{ratios[f'c{c}']['max']:.3f})",
                     str(sum(x["unparsed"] for x in runs[f"schema c{c}"]))])
    header = ["concurrency", "TPOT p50 free (ms)", "TPOT p50 schema (ms)", "ratio, median (min-max) over rounds",
              "replies that did not parse"]
    name = args.model or "SmolLM2-135M-Instruct"
    title = (f"JSON schema vs free text, {name}: {args.num_requests} chat prompts per level, greedy, "
             f"{args.rounds} alternating rounds")
    mask = (f"mask (`Guide.allowed`, 49k vocabulary): p50 {cost['mask_us_p50']:.0f} µs, p99 {cost['mask_us_p99']:.0f} "
            f"µs per row; accept p50 {cost['accept_us_p50']:.0f} µs; over {cost['rows']} rows; llguidance tokenizer "
            f"built in {cost['tokenizer_build_s']:.2f} s at the first constrained request")
    report = f"### {title}\n\n{table(header, rows)}\n\n{mask}\n"
    print("\n" + report)
    (out / "tables.md").write_text(report)
    write_json(out / "results.json", {"mode": "structured", "machine": machine(), "args": vars(args), "runs": runs,
                                      "ratios": ratios, "mask": cost,
                                      "overruns": "mstar_kv_footprint_overruns_total" in metrics})
    _plot(out / "plot.png", runs, args.concurrency, title)
    return out


def _parses(text: str) -> bool:
    import json

    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _plot(path: Path, runs: dict, levels: list[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, dx in (("free", -0.2), ("schema", 0.2)):
        for i, c in enumerate(levels):
            ys = [x["tpot_p50_ms"] for x in runs[f"{kind} c{c}"]]
            ax.bar(i + dx, statistics.median(ys), 0.4, color="C0" if kind == "free" else "C1",
                   label=kind if i == 0 else None)
            ax.plot([i + dx] * len(ys), ys, "k.", ms=4)
    ax.set_xticks(range(len(levels)), [f"c{c}" for c in levels])
    finish_tpot_bars(fig, ax, path, title)
