"""`python -m bench spec`: what prompt-lookup speculation buys, on text that repeats itself
and on text that does not, against the same server without it.

Two servers in turn (`--speculative-k 0`, then `--speculative-k K`), the same requests:
- repetitive: chat requests asking to copy a paragraph (the answer is mostly n-grams of
  the prompt, as in editing, extraction, quoting, code refactors);
- open: chat questions whose answers are new prose (drafts come only from the answer's
  own phrases: the realistic case where speculation helps least);
- random: random token ids of the same lengths as the repetitive prompts (nothing in the
  prompt to copy; a small model's greedy answer to noise tends to loop, which lookup then
  drafts from the output itself).
Greedy, so both servers must return the same tokens (checked, and reported). Acceptance
is the change of `mstar_spec_accepted_tokens_total / mstar_spec_draft_tokens_total` over
each set. The default model is the embedded SmolLM2-135M-Instruct: a random-weight
checkpoint would not continue repeated text, whatever the engine does.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from pathlib import Path

import httpx

from bench.client import Backend, RequestSpec, run_load
from bench.report import finish_tpot_bars, machine, results_dir, table, write_json
from bench.server import MstarServer
from bench.stats import summarize

SENTENCES = [
    "The committee met on Tuesday to review the budget for the new library.",
    "After a long discussion, the members agreed to fund the children's section and the reading room.",
    "The architect was asked to reduce the cost of the roof without changing the design of the entrance.",
    "Volunteers will paint the walls in the spring, and the shelves will arrive in early June.",
    "The mayor thanked the families who had donated books, maps and old photographs of the town.",
    "A small cafe near the entrance will be run by students from the local cooking school.",
    "The opening is planned for September, when the school year starts again.",
    "Until then, the old building on Market Street stays open every day except Sunday.",
]


def repetitive_prompts(n: int, seed: int) -> list[str]:
    """Chat-formatted requests to copy a paragraph of shuffled sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        para = " ".join(rng.sample(SENTENCES, 5))
        out.append(f"<|im_start|>user\nRepeat the following text exactly, word for word:\n\n{para}<|im_end|>\n"
                   "<|im_start|>assistant\n")
    return out


QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle gear system works to a ten-year-old.",
    "Describe a walk through a forest in autumn.",
    "What are the pros and cons of working from home?",
    "Write a letter to a friend about your summer holiday.",
    "Explain why the sky is blue.",
    "Describe your favourite meal and how to cook it.",
    "Write a short poem about the sea, then explain its meaning.",
]


def open_prompts(n: int) -> list[str]:
    return [f"<|im_start|>user\n{QUESTIONS[i % len(QUESTIONS)]}<|im_end|>\n<|im_start|>assistant\n" for i in range(n)]


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def value(name: str) -> float:
        m = re.search(rf"^{name}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return value("mstar_spec_draft_tokens_total"), value("mstar_spec_accepted_tokens_total")


def measure(url: str, sets: dict[str, list[RequestSpec]], concurrency: list[int], timeout: float) -> dict:
    out: dict = {}
    for name, reqs in sets.items():
        for c in concurrency:
            d0, a0 = spec_counters(url)
            results, wall, cpu = asyncio.run(run_load(url, Backend(), reqs, c, timeout=timeout))
            time.sleep(0.6)  # the worker's counters reach /metrics within a stats interval
            d1, a1 = spec_counters(url)
            s = summarize(results, wall, cpu, c)
            s["drafted"], s["accepted"] = d1 - d0, a1 - a0
            s["token_ids"] = [r.token_ids for r in results]
            out[f"{name} c{c}"] = s
    return out


def spec(args) -> Path:
    out = results_dir(args.out)
    from shared.model_source import ModelSource

    tok = ModelSource(args.model).tokenizer.tokenizer
    texts = repetitive_prompts(args.num_requests, args.seed)
    rep = [RequestSpec(tok.encode(t, add_special_tokens=False).ids, args.output_len) for t in texts]
    rng = random.Random(args.seed + 1)
    vocab = tok.get_vocab_size()
    rnd = [RequestSpec([rng.randrange(100, vocab) for _ in r.prompt], args.output_len) for r in rep]
    opn = [RequestSpec(tok.encode(t, add_special_tokens=False).ids, args.output_len)
           for t in open_prompts(args.num_requests)]
    sets = {"repetitive": rep, "open": opn, "random": rnd}
    warm = [RequestSpec(rep[0].prompt, 4)]
    runs: dict[str, dict] = {}
    for k in (0, args.k):
        flags = ["--speculative-k", str(k), "--speculative-ngram-max", str(args.ngram_max),
                 "--speculative-ngram-min", str(args.ngram_min), *args.serve_arg]
        print(f"starting mstar serve --speculative-k {k} ...", file=sys.stderr)
        server = MstarServer(args.model, out / "logs" / f"mstar-k{k}.log", flags).start()
        try:
            asyncio.run(run_load(server.url, Backend(), warm, 1, timeout=args.timeout))
            runs[f"k={k}"] = measure(server.url, sets, args.concurrency, args.timeout)
        finally:
            server.stop()
    base, fast = runs["k=0"], runs[f"k={args.k}"]
    rows, ratios = [], {}
    for key in base:
        b, f = base[key], fast[key]
        same = b["token_ids"] == f["token_ids"]
        acc = f["accepted"] / f["drafted"] if f["drafted"] else 0.0
        speedup = b["tpot_ms"]["p50"] / f["tpot_ms"]["p50"]
        ratios[key] = {"tpot_speedup": speedup, "throughput_speedup": f["output_throughput"] / b["output_throughput"],
                       "acceptance": acc, "identical_tokens": same}
        rows.append([key, f"{b['output_throughput']:.1f}", f"{f['output_throughput']:.1f}",
                     f"{b['tpot_ms']['p50']:.2f}", f"{f['tpot_ms']['p50']:.2f}", f"{speedup:.2f}x",
                     f"{int(f['drafted'])}", f"{acc:.0%}", "yes" if same else "NO"])
    header = ["set", "tok/s k=0", f"tok/s k={args.k}", "TPOT p50 k=0 (ms)", f"TPOT p50 k={args.k} (ms)",
              "speed-up (TPOT)", "drafts", "accepted", "same tokens"]
    name = args.model or "SmolLM2-135M-Instruct"
    title = (f"prompt-lookup speculation, {name}: k={args.k}, n-gram {args.ngram_min}-{args.ngram_max}, "
             f"{args.num_requests} requests per set, ~{len(rep[0].prompt)} prompt / {args.output_len} output tokens, "
             "greedy, ignore_eos")
    report = f"### {title}\n\n{table(header, rows)}\n"
    print("\n" + report)
    (out / "tables.md").write_text(report)
    for r in list(base.values()) + list(fast.values()):
        r.pop("token_ids")
    write_json(out / "results.json", {"mode": "spec", "machine": machine(), "args": vars(args), "runs": runs,
                                      "ratios": ratios})
    _plot(out / "plot.png", base, fast, args.k, title)
    return out


def _plot(path: Path, base: dict, fast: dict, k: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(base)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [base[q]["tpot_ms"]["p50"] for q in keys], 0.4, label="k=0")
    ax.bar([i + 0.2 for i in x], [fast[q]["tpot_ms"]["p50"] for q in keys], 0.4, label=f"k={k}")
    ax.set_xticks(list(x), keys)
    finish_tpot_bars(fig, ax, path, title)
