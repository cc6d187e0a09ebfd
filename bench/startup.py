"""`python -m bench.startup`: start-up and idle memory of `mstar serve` on the default model
(SmolLM2-135M Q4_1 GGUF), median of several starts, optionally alternated with another
checkout's so that both see the same machine load (issue 49).

Per start: launch (`Popen`) to the first 200 from `/ready`, when each service logged its
first line and the gpu worker its `ready` (seconds after launch: the timeline), the CPU
seconds each process had used at ready (what a start costs a machine of few cores), and one
second after ready each process's RSS and PSS (/proc/PID/status VmRSS,
/proc/PID/smaps_rollup Pss; the tree's sum of each, as bench/server.py measures them: RSS
counts shared pages once per process, PSS splits them). The load average is printed with
every start; compare figures only from one run.

    python -m bench.startup -n 5
    python -m bench.startup -n 5 --baseline ../main     # alternate with another checkout
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.report import results_dir, write_json
from bench.server import REPO, Server, free_port

#: a service's log line: "2026-12-07 19:37:02,033 INFO conductor[22676] ..."
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ ([a-z_]+)(?::[\w-]+)?\[\d+\] (.*)$")


class CheckoutServer(Server):
    """`mstar serve` (default model) from the checkout at `repo`."""

    kind = "mstar"

    def __init__(self, repo: Path, log_path: Path, extra: list[str]) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "services.launcher", "serve", "--port", str(port), *extra]
        super().__init__(argv, port, log_path, {"PYTHONPATH": str(repo), "MSTAR_LOG_FORMAT": "text"})
        self.cwd = repo  # `-m services...` finds this checkout's first
        self.launched = 0.0

    def start(self, timeout: float = 600.0) -> Server:
        self.launched = time.time()
        return super().start(timeout)


def timeline(log: str, launched: float) -> dict[str, float]:
    """Seconds after launch of each service's first log line, and of the gpu worker's ready."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - launched
        out.setdefault(f"{m.group(2)} first line", round(t, 3))
        if m.group(2) == "gpu_worker" and " ready at " in f" {m.group(3)}":
            out.setdefault("gpu_worker ready", round(t, 3))
    return out


def cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU time (user + system) each process has used so far, by its `-m` module: at ready,
    what its start cost, which the machine's load inflates far less than the wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = argv[2].decode() if len(argv) > 2 and argv[1] == b"-m" else argv[0].decode()
        out[name] = round((int(fields[11]) + int(fields[12])) / tick, 2)
    return out


def one_start(repo: Path, log_path: Path, extra: list[str]) -> dict:
    load = os.getloadavg()[0]
    server = CheckoutServer(repo, log_path, extra)
    server.start()
    try:
        cpu = cpu_seconds(server.pids())
        time.sleep(1.0)
        mem = server.memory()
    finally:
        server.stop()
    per = {p["cmd"].split(" -m ")[-1].split()[0]: {"rss_mib": round(p["rss_mib"], 1), "pss_mib": round(p["pss_mib"], 1)}
           for p in mem["per_process"]}
    return {"startup_s": server.startup_s, "load": load, "rss_mib": mem["rss_mib"], "pss_mib": mem["pss_mib"],
            "cpu_s": sum(cpu.values()), "cpu_s_per_process": cpu, "per_process": per,
            "timeline": timeline(server.log_tail(1 << 20), server.launched)}


def summary(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in ("startup_s", "rss_mib", "pss_mib", "load", "cpu_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=5, help="starts per checkout (default 5)")
    p.add_argument("--baseline", default=None, help="another checkout, started in alternation with this one")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out_dir = results_dir(args.out)
    repos = {"this": REPO} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    runs: dict[str, list[dict]] = {name: [] for name in repos}
    for i in range(args.n):
        for name, repo in (repos.items() if i % 2 == 0 else reversed(repos.items())):
            r = one_start(repo, out_dir / f"{name}-{i}.log", args.serve_arg)
            runs[name].append(r)
            procs = ", ".join(f"{k} {v['rss_mib']:.0f}/{v['pss_mib']:.0f}" for k, v in r["per_process"].items())
            print(f"{name} {i}: start-up {r['startup_s']:.2f} s (load {r['load']:.1f}); RSS {r['rss_mib']:.0f} MiB, "
                  f"PSS {r['pss_mib']:.0f} MiB [{procs}]; CPU s at ready {r['cpu_s_per_process']}; "
                  f"{r['timeline']}", flush=True)
    for name in repos:
        s = summary(runs[name])
        print(f"{name} ({repos[name]}): median start-up {s['startup_s']:.2f} s, CPU {s['cpu_s']:.2f} s, idle RSS "
              f"{s['rss_mib']:.0f} MiB, PSS {s['pss_mib']:.0f} MiB over {args.n} starts, median load {s['load']:.1f}")
    write_json(out_dir / "results.json", {"repos": {k: str(v) for k, v in repos.items()}, "runs": runs,
                                          "summary": {k: summary(v) for k, v in runs.items()}})
    print("results in", out_dir)


if __name__ == "__main__":
    main()
