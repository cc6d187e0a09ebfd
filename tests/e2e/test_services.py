"""Each service starts alone and answers --help; the four started one by one (as in
development or compose) serve a request; the launcher leaves no child when killed and
exits non-zero with the child's error when one fails at start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.servers import REPO, MstarServer, free_port, serve_until_exit, service_env

SERVICES = ["api", "data_worker", "conductor", "gpu_worker"]


@pytest.mark.parametrize("service", SERVICES)
def test_service_help(service):
    r = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], cwd=REPO, env=service_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"services.{service}" in r.stdout
    assert "--conductor-addr" in r.stdout or (service == "conductor" and "--conductor-control-addr" in r.stdout)


def test_launcher_help():
    r = subprocess.run([sys.executable, "-m", "services.launcher", "serve", "--help"], cwd=REPO, env=service_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--model" in r.stdout and "--port" in r.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_killing_the_launcher_leaves_no_child(llama_ckpt, tmp_path):
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "32").start()
    try:
        children = server.children()
        assert len(children) == 4
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)]
    finally:
        server.stop()


def test_sigterm_stops_every_child(llama_ckpt, tmp_path):
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "32").start()
    children = server.children()
    assert server.stop() == 0
    assert not [p for p in children if _alive(p)]


def test_launcher_refuses_an_unsupported_model_before_any_child(tmp_path):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    r = serve_until_exit("--model", str(bad))
    assert r.returncode == 2
    assert r.stderr.startswith("mstar: deployment refused: architecture 'NoSuchForCausalLM' is not supported")


def test_launcher_exits_nonzero_with_child_error(llama_ckpt, tmp_path):
    """A model the deployment check accepts but a worker cannot load (no weight files):
    the child's error, then the launcher stops the rest and exits non-zero."""
    import shutil

    bad = tmp_path / "no-weights"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_ckpt / name, bad / name)
    r = serve_until_exit("--model", str(bad))
    assert r.returncode != 0
    assert "has no *.safetensors files" in r.stderr
    assert "failed to start" in r.stderr


def test_services_started_one_by_one(llama_ckpt, tmp_path):
    """The development path: four `python -m services.<name>` with explicit addresses."""
    run = tmp_path / "run"
    addr = {n: f"ipc://{run}/{n}.sock" for n in ("api", "dw", "cond", "ctl", "w0")}
    port = free_port()
    common = ["--model", str(llama_ckpt)]
    argvs = [
        ["services.conductor", *common, "--conductor-addr", addr["cond"], "--conductor-control-addr", addr["ctl"]],
        ["services.gpu_worker", *common, "--num-kv-pages", "32", "--bind-addr", addr["w0"],
         "--conductor-addr", addr["cond"]],
        ["services.data_worker", *common, "--data-worker-addr", addr["dw"], "--conductor-addr", addr["cond"]],
        ["services.api", *common, "--port", str(port), "--api-addr", addr["api"], "--data-worker-addr", addr["dw"],
         "--conductor-addr", addr["cond"], "--conductor-control-addr", addr["ctl"]],
    ]
    logs = open(tmp_path / "log.txt", "wb")
    procs = [subprocess.Popen([sys.executable, "-m", *a], cwd=REPO, env=service_env(), stdout=logs,
                              stderr=subprocess.STDOUT)
             for a in argvs]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert all(p.poll() is None for p in procs), (tmp_path / "log.txt").read_text()
            time.sleep(0.25)
        r = httpx.post(url + "/generate",
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 4
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        logs.close()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], (tmp_path / "log.txt").read_text()[-3000:]
    assert not list(run.glob("*.sock")), "stale ipc sockets left behind"
