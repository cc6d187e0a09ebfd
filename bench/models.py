"""What several models behind one deployment cost (issue 57, docs/deploy.md): start-up and
RSS per process of one model, three behind one `--models-dir`, and three under
`--models-max 1`, and the time one swap takes (`POST /models/load` of the model not loaded
until it is), side by side in one run. Tiny random checkpoints (a Llama, a Qwen3 embedder,
a Whisper: tests/e2e/test_models_dir.py's), so the figures are the serving machinery's.

    python -m bench.models [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.report import machine, results_dir, table, write_json
from tests.servers import MstarServer

ROLES = ("gpu_worker", "data_worker", "conductor", "api")


def make_models(root: Path) -> Path:
    from tests.checkpoints import make_checkpoint
    from tests.e2e.test_models_dir import make_embedder
    from tests.whisper_checkpoints import make_whisper_checkpoint

    make_checkpoint(root / "chat", "llama")
    make_embedder(root / "embed")
    make_whisper_checkpoint(root / "whisper")
    return root


def rss_by_role(pid: int) -> dict[str, list[int]]:
    """MiB of each child of the launcher, by its service."""
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "rss=,args="], capture_output=True, text=True).stdout
    roles: dict[str, list[int]] = {}
    for line in out.splitlines():
        kb, args = line.strip().split(" ", 1)
        role = next((r for r in ROLES if f"services.{r}" in args), "other")
        roles.setdefault(role, []).append(int(kb) // 1024)
    return roles


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(url + "/models", timeout=10).json()["data"]}


def measure(label: str, flags: list[str], logs: Path) -> dict:
    slug = "".join(c if c.isalnum() else "-" for c in label)
    srv = MstarServer("", logs / f"{slug}.log", "--num-kv-pages", "64")
    at = srv.argv.index("--model")
    srv.argv[at:at + 2] = flags
    t0 = time.monotonic()
    srv.start()
    res: dict = {"label": label, "ready_s": round(time.monotonic() - t0, 1)}
    try:
        if "--models-dir" in flags and "--models-max" not in flags:
            while set(states(srv.url).values()) != {"loaded"}:
                time.sleep(0.1)
            res["all_loaded_s"] = round(time.monotonic() - t0, 1)
        res["rss_mib"] = rss_by_role(srv.proc.pid)
        if "--models-max" in flags:
            waiting = next(n for n, s in states(srv.url).items() if s == "unloaded")
            t1 = time.monotonic()
            httpx.post(srv.url + "/models/load", json={"model": waiting}, timeout=10)
            while states(srv.url)[waiting] != "loaded":
                time.sleep(0.05)
            res["swap_s"] = round(time.monotonic() - t1, 1)
    finally:
        srv.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default bench/results/<time>)")
    args = ap.parse_args()
    out = results_dir(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        root = make_models(Path(tmp) / "models")
        runs = [measure("one model", ["--model", str(root / "chat")], out),
                measure("three models", ["--models-dir", str(root)], out),
                measure("three, --models-max 1", ["--models-dir", str(root), "--models-max", "1"], out)]
    rows = [[r["label"], f"{r['ready_s']:.1f}", str(r.get("all_loaded_s", "-")), str(r.get("swap_s", "-")),
             *(" + ".join(map(str, r["rss_mib"].get(role, []))) or "-" for role in ROLES)] for r in runs]
    print(table(["deployment", "/ready s", "all loaded s", "swap s", *(f"{r} MiB" for r in ROLES)], rows))
    write_json(out / "results.json", {"machine": machine(), "runs": runs})
    _plot(out / "plot.png", runs)
    print(f"results in {out}")


def _plot(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(runs)
    for role in ROLES:
        heights = [sum(r["rss_mib"].get(role, [])) for r in runs]
        ax.bar([r["label"] for r in runs], heights, bottom=bottom, label=role)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("RSS, MiB (sum over processes)")
    ax.set_title("one model vs several behind one deployment")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
