"""Start real mstar processes for tests: free loopback ports, logs captured to a file,
every process (and its children) gone at teardown."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.checkpoints import make_checkpoint

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_labels(text: str) -> dict[str, str]:
    """`{a="x",b="y"}` (braces optional) as a dict."""
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def service_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MSTAR_TORCH_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def serve_until_exit(*argv: str, env: dict[str, str] | None = None,
                     timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`mstar serve <argv> --port <free>` that is expected to exit by itself (a refusal, a
    child failing at start): its exit code and output."""
    return subprocess.run([sys.executable, "-m", "services.launcher", "serve", *argv, "--port", str(free_port())],
                          cwd=REPO, env=service_env(**(env or {})), capture_output=True, text=True, timeout=timeout)


class MstarServer:
    """`mstar serve` as a child process (the launcher starts the four services)."""

    def __init__(self, model: str, log_path: Path, *args: str, env: dict[str, str] | None = None,
                 python: str = sys.executable) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [python, "-m", "services.launcher", "serve", "--model", model, "--port", str(self.port), *args]
        self.env = service_env(**(env or {}))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240.0) -> MstarServer:
        return self.launch().wait_ready(timeout)

    def launch(self) -> MstarServer:
        """Start the launcher without waiting for it (a test computes its reference meanwhile:
        `wait_ready` then)."""
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 240.0) -> MstarServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mstar serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            # The launcher says so once /ready is 200 (and from then on it supervises).
            if "mstar: ready on" in self.log():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mstar serve not ready after {timeout}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        """Pids of the launcher's direct children."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def metric(self, name: str, labels: str = "") -> float:
        """The sum of `name` over the series whose labels include `labels` (`'{pool="kv"}'`;
        every series carries `model_name` too)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        want = parse_labels(labels).items()
        pat = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})?\s+([0-9.eE+-]+)$", re.M)
        vals = [float(v) for got, v in pat.findall(text) if want <= parse_labels(got).items()]
        if not vals:
            raise KeyError(f"{name}{labels} not in /metrics")
        return sum(vals)

    def wait_metric(self, name: str, want: float, timeout: float = 5.0) -> float:
        """The metric's value once it equals `want` (metrics trail the workers by a few
        hundred ms), or its last value after `timeout`."""
        deadline = time.monotonic() + timeout
        value = self.metric(name)
        while value != want and time.monotonic() < deadline:
            time.sleep(0.1)
            value = self.metric(name)
        return value

    def wait_pages_free(self, timeout: float = 5.0) -> float:
        """Used KV pages, once they reach zero (or after `timeout`). A server that has not
        published its pools yet (just started, asked nothing: the api has seen no cluster
        status) is waited for too, within the same `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                used = self.metric("mstar_kv_pages_used")
            except KeyError:
                if time.monotonic() >= deadline:
                    raise
                used = None
            if used == 0 or (used is not None and time.monotonic() >= deadline):
                return used
            time.sleep(0.1)

    def assert_clean(self) -> None:
        """Every page back (the debug-assert servers' check after a test), and no footprint
        overrun, untight footprint or failed request in the log."""
        assert self.wait_pages_free() == 0
        log = self.log()
        assert "footprint overrun" not in log and "not tight" not in log and "failed (error_id=" not in log

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in the group
        except ProcessLookupError:
            pass
        self._log.close()
        return self.proc.returncode


class ServiceStack:
    """The four services as separate processes with explicit ipc addresses, as compose.yaml
    runs them (one per container), so a test can start, kill or restart any one of them.
    `workers` maps a worker id to its extra flags."""

    def __init__(self, model: str, tmp_path: Path, workers: dict[str, list[str]],
                 conductor_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        run = tmp_path / "run"
        run.mkdir(exist_ok=True)
        self.tmp_path = tmp_path
        self.addr = {n: f"ipc://{run}/{n}.sock" for n in ("api", "dw", "cond", "ctl", *workers)}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = service_env(MSTAR_RUN_DIR=str(run), **(env or {}))
        common = ["--model", model]
        a = self.addr
        self.argvs: dict[str, list[str]] = {
            "conductor": ["services.conductor", *common, "--conductor-addr", a["cond"],
                          "--conductor-control-addr", a["ctl"], *conductor_args],
            **{wid: ["services.gpu_worker", *common, *flags, "--worker-id", wid, "--bind-addr", a[wid],
                     "--conductor-addr", a["cond"]] for wid, flags in workers.items()},
            "data_worker": ["services.data_worker", *common, "--data-worker-addr", a["dw"], "--conductor-addr",
                            a["cond"]],
            "api": ["services.api", *common, "--port", str(self.port), "--api-addr", a["api"],
                    "--data-worker-addr", a["dw"], "--conductor-addr", a["cond"], "--conductor-control-addr",
                    a["ctl"]],
        }
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str | None = None) -> ServiceStack:
        for n in [name] if name else list(self.argvs):
            log = open(self.tmp_path / f"{n}.log", "ab")
            self.procs[n] = subprocess.Popen([sys.executable, "-m", *self.argvs[n]], cwd=REPO, env=self.env,
                                             stdout=log, stderr=subprocess.STDOUT)
            log.close()
        return self

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def wait_ready(self, workers: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/ready", timeout=2)
                if r.status_code == 200 and r.json().get("ready_workers") == workers:
                    return
            except httpx.HTTPError:
                pass
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, (dead, {n: self.log(n)[-2000:] for n in dead})
            time.sleep(0.2)
        raise TimeoutError(f"not {workers} ready workers after {timeout}s")

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        p.kill()
        p.wait()

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        want = parse_labels(labels).items()
        pat = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})?\s+([0-9.eE+-]+)$", re.M)
        return sum(float(v) for got, v in pat.findall(text) if want <= parse_labels(got).items())

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@contextmanager
def served_with_template(folder: Path, family: str, template: str, max_positions: int,
                         pages: int) -> Iterator[tuple]:
    """(an openai client, the served name) of a random `family` checkpoint made in `folder`
    with `max_positions` positions, served with chat template `template`."""
    import openai

    ckpt = make_checkpoint(folder / f"tiny-{family}", family, max_position_embeddings=max_positions)
    (folder / "template.jinja").write_text(template)
    server = MstarServer(str(ckpt), folder / "log.txt", "--num-kv-pages", str(pages),
                         "--chat-template", str(folder / "template.jinja")).start()
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120), ckpt.name
    finally:
        server.stop()


def assert_clean(srv: MstarServer) -> None:
    """Pages (and state slots) back to 0; nothing overran a footprint; no request failed."""
    assert srv.wait_pages_free() == 0
    assert srv.metric("mstar_kv_footprint_overruns_total") == 0
    log = srv.log()
    assert "footprint overrun" not in log and "not tight" not in log and "failed (error_id=" not in log


def ws_generate(url: str, model: str, bodies: list[dict], timeout: float = 120.0) -> list[dict]:
    """Every body as a `/generate` frame over one `/generate/ws?model=<model>` socket, all
    live at once (`stream` false): each one's done frame, in the bodies' order. The
    WebSocket is the /generate route that names its model (several models served), so a
    test gets each model's token ids."""
    import json

    from websockets.sync.client import connect

    with connect(url.replace("http://", "ws://", 1) + f"/generate/ws?model={model}") as ws:
        for i, body in enumerate(bodies):
            ws.send(json.dumps({"type": "generate", "id": str(i), "stream": False, **body}))
        done: dict[str, dict] = {}
        while len(done) < len(bodies):
            frame = json.loads(ws.recv(timeout))
            assert frame["type"] == "done", frame
            done[frame["id"]] = frame
    return [done[str(i)] for i in range(len(bodies))]
