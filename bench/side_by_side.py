"""The table, JSON and PNG of a mode that runs mstar and one reference side by side in
rounds (`python -m bench vision`, `speech`): each figure's median per system, and the
per-round ratio (mstar better by) with its spread."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from bench.report import machine, table, write_json


class Figure(NamedTuple):
    name: str
    key: str  # in each round's dict
    scale: float = 1.0
    higher_is_better: bool = False


def report(out: Path, runs: dict[str, list[dict]], figures: list[Figure], reference: str, title: str,
           extra: dict[str, Any]) -> Path:
    """Print and write the comparison of `runs["mstar"]` with `runs[reference]`."""
    rows, ratios = [], {}
    for f in figures:
        ours = [x[f.key] * f.scale for x in runs["mstar"]]
        theirs = [x[f.key] * f.scale for x in runs[reference]]
        per = [(a / b if f.higher_is_better else b / a) for a, b in zip(ours, theirs)]
        ratios[f.name] = {"median": statistics.median(per), "min": min(per), "max": max(per)}
        r = ratios[f.name]
        rows.append([f.name, f"{statistics.median(ours):.2f}", f"{statistics.median(theirs):.2f}",
                     f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"])
    text = table(["figure", "mstar", reference, "mstar better by"], rows)
    print(text)
    (out / "tables.md").write_text(text + "\n")
    write_json(out / "results.json", {"machine": machine(), "runs": runs, "ratios": ratios, **extra})
    _plot(out / "plot.png", rows, reference, f"{title}, {os.cpu_count()} CPUs")
    return out


def _plot(path: Path, rows: list[list[str]], reference: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(10, 3.6))
    for ax, row in zip(axes, rows):
        ax.bar(["mstar", reference], [float(row[1]), float(row[2])], color=["tab:blue", "tab:gray"])
        ax.set_title(row[0], fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
