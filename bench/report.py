"""Results: the printed (markdown) tables, results.json and plot.png in the results folder."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def results_dir(out: str | None) -> Path:
    path = Path(out) if out else REPO / "bench" / "results" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip())
    import torch

    return {
        "cpus": os.cpu_count(), "cpu_model": model, "memory_gib": round(mem_gib, 1), "gpu": None,
        "python": platform.python_version(), "torch": torch.__version__, "git": commit + ("+dirty" if dirty else ""),
        "load_avg_start": os.getloadavg(), "time": dt.datetime.now().isoformat(timespec="seconds"),
        "MSTAR_TORCH_THREADS": os.environ.get("MSTAR_TORCH_THREADS"),
    }


def _f(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


LEVEL_HEADER = ["system", "conc", "reqs", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                "TPOT p50", "E2E p50", "E2E p99", "errors"]


def level_rows(name: str, levels: list[dict]) -> list[list[str]]:
    rows = []
    for s in levels:
        rows.append([name, str(s["concurrency"]), str(s["completed"]), _f(s["output_throughput"]),
                     _f(s["request_throughput"], 2), _f(s["ttft_ms"]["p50"]), _f(s["ttft_ms"]["p99"]),
                     _f(s["itl_ms"]["p50"], 2), _f(s["itl_ms"]["p99"], 2), _f(s["tpot_ms"]["p50"], 2),
                     _f(s["latency_ms"]["p50"]), _f(s["latency_ms"]["p99"]), str(s["num_errors"])])
    return rows


def hf_rows(hf: dict) -> list[list[str]]:
    rows = []
    for b in hf["batches"].values():
        if b["batch"] == 1:
            rows.append(["hf generate", "b1", str(b["requests"]), _f(b["output_throughput"]), "-",
                         _f(b["ttft_ms"]["p50"]), _f(b["ttft_ms"]["p99"]), _f(b["itl_ms"]["p50"], 2),
                         _f(b["itl_ms"]["p99"], 2), _f(b["tpot_ms"]["p50"], 2),
                         _f(b["latency_ms"]["p50"]), _f(b["latency_ms"]["p99"]), "0"])
        else:
            rows.append(["hf generate", f"b{b['batch']}", str(b["requests"]), _f(b["output_throughput"]), "-",
                         _f(b["prefill_ms"]), "-", _f(b["step_ms"], 2), "-", _f(b["step_ms"], 2),
                         _f(b["duration_s"] * 1e3), "-", "0"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: (  # noqa: E731
        "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |")
    sep = "|" + "|".join("-" * (w + 1) + ":" if i else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, default=float))


def plot(path: Path, servers: dict[str, dict], hf: dict | None = None, title: str = "") -> None:
    """2x2: output tok/s, TTFT p50, ITL p50/p99 against concurrency (HF's batches at their
    batch size), and the ITL distribution at the lowest concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_tp, ax_ttft), (ax_itl, ax_cdf) = axes
    for name, srv in servers.items():
        levels = srv.get("levels") or []
        if not levels:
            continue
        c = [s["concurrency"] for s in levels]
        ax_tp.plot(c, [s["output_throughput"] for s in levels], "o-", label=name)
        ax_ttft.plot(c, [s["ttft_ms"]["p50"] for s in levels], "o-", label=f"{name} p50")
        ax_ttft.plot(c, [s["ttft_ms"]["p99"] for s in levels], "x:", color=ax_ttft.lines[-1].get_color(),
                     label=f"{name} p99")
        ax_itl.plot(c, [s["itl_ms"]["p50"] for s in levels], "o-", label=f"{name} p50")
        ax_itl.plot(c, [s["itl_ms"]["p99"] for s in levels], "x:", color=ax_itl.lines[-1].get_color(),
                    label=f"{name} p99")
        sample = sorted(levels[0].get("itl_sample_ms") or [])
        if sample:
            ax_cdf.plot(sample, [(i + 1) / len(sample) for i in range(len(sample))],
                        label=f"{name} c{levels[0]['concurrency']}")
    if hf:
        bs = [b["batch"] for b in hf["batches"].values()]
        ax_tp.plot(bs, [b["output_throughput"] for b in hf["batches"].values()], "s--", label="hf generate (batch)")
        b1 = hf["batches"].get("1")
        steps = [(b["batch"], b["itl_ms"]["p50"] if b["batch"] == 1 else b["step_ms"]) for b in hf["batches"].values()]
        ax_itl.plot([s[0] for s in steps], [s[1] for s in steps], "s--", label="hf generate per token")
        if b1:
            ax_ttft.plot([1], [b1["ttft_ms"]["p50"]], "s", label="hf generate b1 p50")
            sample = sorted(b1.get("itl_sample_ms") or [])
            if sample:
                ax_cdf.plot(sample, [(i + 1) / len(sample) for i in range(len(sample))], "--", label="hf generate b1")
    for ax, ylabel in ((ax_tp, "output tokens/s"), (ax_ttft, "TTFT (ms)"), (ax_itl, "ITL (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (HF: batch size)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax_itl.set_yscale("log")
    ax_ttft.set_yscale("log")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("ITL (ms), lowest concurrency")
    ax_cdf.set_ylabel("fraction of tokens")
    ax_cdf.grid(True, alpha=0.3)
    ax_cdf.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish_tpot_bars(fig, ax, path: Path, title: str) -> None:
    """The tail of a bar plot of TPOT p50 per set (bench spec, bench structured): axis
    label, legend, grid, title; written to `path` and closed."""
    import matplotlib.pyplot as plt

    ax.set_ylabel("time per output token, p50 (ms)")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
