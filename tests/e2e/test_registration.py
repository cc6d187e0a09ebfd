"""Multi-host safety through real processes: a conductor started for one model refuses a
worker that loaded another model, or the same model under another deployment, with a log
line naming both; the refused worker exits with status 2 and that message. A worker that
matches (its own pool size may differ) joins."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.servers import REPO, service_env


def _start(args: list[str], log, tmp_path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=service_env(MSTAR_RUN_DIR=str(tmp_path)),
                            stdout=log, stderr=subprocess.STDOUT)


def test_conductor_refuses_a_worker_with_another_model_or_deployment(llama_ckpt, qwen2_ckpt, tmp_path):
    cond_addr = f"ipc://{tmp_path}/cond.sock"
    cond_log = open(tmp_path / "conductor.log", "wb")
    conductor = _start(["services.conductor", "--model", str(llama_ckpt), "--conductor-addr", cond_addr,
                        "--conductor-control-addr", f"ipc://{tmp_path}/ctl.sock"], cond_log, tmp_path)
    workers = {
        "other-model": ["--model", str(qwen2_ckpt)],
        "other-page-size": ["--model", str(llama_ckpt), "--page-size", "8", "--num-kv-pages", "128"],
        "matching": ["--model", str(llama_ckpt), "--num-kv-pages", "24"],  # its own pool size: fine
    }
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in workers}
    procs = {name: _start(["services.gpu_worker", "--num-kv-pages", "32", *argv, "--worker-id", name,
                           "--bind-addr", f"ipc://{tmp_path}/{name}.sock", "--conductor-addr", cond_addr],
                          logs[name], tmp_path)
             for name, argv in workers.items()}
    try:
        for name in ("other-model", "other-page-size"):
            assert procs[name].wait(120) == 2, (tmp_path / f"{name}.log").read_text()[-3000:]
        deadline = time.monotonic() + 120
        while "worker matching ready" not in (tmp_path / "conductor.log").read_text():
            assert procs["matching"].poll() is None, (tmp_path / "matching.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "conductor.log").read_text()
            time.sleep(0.2)
    finally:
        for p in [*procs.values(), conductor]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*procs.values(), conductor]:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in [cond_log, *logs.values()]:
            f.close()
    cond = (tmp_path / "conductor.log").read_text()
    other = (tmp_path / "other-model.log").read_text()
    # Both models named, in the conductor's log and in the worker's exit message.
    for text in (cond, other):
        assert "worker other-model" in text and "refused: it loaded model tiny-qwen2 (sha256 " in text, text
        assert "this conductor serves tiny-llama (sha256 " in text, text
    assert "gpu_worker: refused by the conductor:" in other
    page = (tmp_path / "other-page-size.log").read_text()
    for text in (cond, page):
        assert "worker other-page-size" in text, text
        assert "its deployment differs in page_size (worker 8, conductor 16)" in text, text
        assert "loaded model" not in text.split("worker other-page-size", 1)[1].split("\n", 1)[0]
    assert procs["matching"].returncode == 0 and conductor.returncode == 0
