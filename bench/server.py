"""Start a server under test (mstar or the vLLM CPU peer) on a free port, time its start-up
to ready, measure its process tree's memory via /proc, and stop it (the whole tree)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO.parent / "shared" / "peers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(root: int) -> list[int]:
    """`root` and every descendant, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _rollup_kb(pid: int) -> dict[str, int]:
    """/proc/<pid>/smaps_rollup's kB fields (Pss, Pss_Anon, Pss_File, Anonymous, ...); {} if gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0])
    except OSError:
        pass
    return out


def tree_memory(root: int) -> dict:
    """Summed RSS (counts shared pages once per process, so it overstates) and summed PSS
    (shared pages split between their users: what the tree costs the machine), in MiB.
    Per process also its PSS split into anonymous memory (heap, tensors, KV pages: what
    the process itself allocated) and file pages (libraries, mapped weights), and its
    anonymous RSS."""
    pids = process_tree(root)
    procs = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        except OSError:
            continue
        roll = _rollup_kb(pid)
        procs.append({"pid": pid, "cmd": name, "rss_mib": _status_kb(pid, "VmRSS") / 1024,
                      "pss_mib": roll.get("Pss", 0) / 1024, "pss_anon_mib": roll.get("Pss_Anon", 0) / 1024,
                      "pss_file_mib": roll.get("Pss_File", 0) / 1024, "anon_rss_mib": roll.get("Anonymous", 0) / 1024})
    return {
        "processes": len(procs),
        "rss_mib": sum(p["rss_mib"] for p in procs),
        "pss_mib": sum(p["pss_mib"] for p in procs),
        "pss_anon_mib": sum(p["pss_anon_mib"] for p in procs),
        "pss_file_mib": sum(p["pss_file_mib"] for p in procs),
        "per_process": procs,
    }


class MemorySampler(threading.Thread):
    """The peak of the tree's summed RSS and PSS while it runs (sampled every `interval`)."""

    def __init__(self, root: int, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_rss = self.peak_pss = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            m = tree_memory(self.root)
            self.peak_rss = max(self.peak_rss, m["rss_mib"])
            self.peak_pss = max(self.peak_pss, m["pss_mib"])
            self._halt.wait(self.interval)

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        return {"peak_rss_mib": self.peak_rss, "peak_pss_mib": self.peak_pss}


class Server:
    """A server process (group) we started; `url`, `startup_s`, `model` once ready."""

    kind = "server"
    ready_path = "/ready"

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.port, self.log_path = argv, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        #: the folder the server runs from (another checkout's, bench/startup.py)
        self.cwd = REPO
        self.startup_s = float("nan")
        self.model = ""

    def start(self, timeout: float = 600.0) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = t0 + timeout
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.argv[:4]} exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(self.ready_path).status_code == 200:
                        self.startup_s = time.perf_counter() - t0
                        self.model = self._model_name(client)
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.argv[:4]} not ready after {timeout}s:\n{self.log_tail()}")

    def _model_name(self, client: httpx.Client) -> str:
        return ""

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def memory(self) -> dict:
        return tree_memory(self.proc.pid)

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid)

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group we started, whatever is left of it
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


class MstarServer(Server):
    kind = "mstar"

    def __init__(self, model: str, log_path: Path, extra: list[str] = (), env: dict[str, str] | None = None) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "services.launcher", "serve", "--model", model, "--port", str(port), *extra]
        pythonpath = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
        super().__init__(argv, port, log_path, {"PYTHONPATH": pythonpath, **(env or {})})


class VllmServer(Server):
    kind = "vllm"
    ready_path = "/health"

    def __init__(self, venv: str, model: str, log_path: Path, extra: list[str] = (),
                 env: dict[str, str] | None = None) -> None:
        port = free_port()
        super().__init__([str(PEERS / "serve-vllm-cpu"), venv, model, str(port), *extra], port, log_path, env)

    def _model_name(self, client: httpx.Client) -> str:
        return client.get("/v1/models").json()["data"][0]["id"]


def vllm_venv() -> str | None:
    """The vLLM CPU peer's venv if it is installed (install-vllm-cpu's default place)."""
    venv = os.environ.get("VLLM_PEER_VENV") or str(Path.home() / ".cache" / "mstar-peers" / "vllm-cpu")
    if Path(venv, "bin", "vllm").exists():
        ok = subprocess.run([f"{venv}/bin/python", "-c", "import vllm"], capture_output=True).returncode == 0
        return venv if ok else None
    return None
