"""The README's install, without the dev extras, serves every client path (issue 27): a
fresh venv gets exactly `pip install 'torch==2.13.0' -e .`, and `mstar serve` from it
answers `/generate/ws` (uvicorn serves WebSockets only when a WebSocket library is
installed: with `websockets` only in the dev extra, every test passed while the documented
install answered 404)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import websockets

from tests.servers import REPO, MstarServer


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: the same packages, without byte-compiling torch's thousands of modules
    # (two thirds of the install's CPU time); the one server started from it imports fewer
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", "torch==2.13.0", "-e", str(REPO)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return str(venv / "bin" / "python")


def test_the_bare_install_has_no_dev_packages(bare_python):
    """The venv is what a user gets: none of the dev extra's test tools (httpx is the api's
    own now: it fetches image URLs)."""
    probe = subprocess.run([bare_python, "-c", "import importlib.util as u; "
                            "print([m for m in ('pytest', 'transformers', 'openai') if u.find_spec(m)])"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "[]"


async def test_the_bare_install_serves_generate_ws(bare_python, llama_ckpt, tmp_path):
    server = MstarServer(str(llama_ckpt), tmp_path / "log.txt", "--num-kv-pages", "64", python=bare_python).start()
    try:
        url = server.url.replace("http://", "ws://") + "/generate/ws"
        async with websockets.connect(url) as ws:
            for i in range(2):
                await ws.send(json.dumps({"type": "generate", "id": f"r{i}", "prompt": "Hello", "max_tokens": 5,
                                          "ignore_eos": True, "temperature": 0}))
            done = {}
            while len(done) < 2:
                frame = json.loads(await ws.recv())
                assert frame["type"] in ("delta", "done"), frame
                if frame["type"] == "done":
                    done[frame["id"]] = frame
        assert set(done) == {"r0", "r1"}
        assert all(len(d["token_ids"]) == 5 and d["finish_reason"] == "length" for d in done.values())
        assert done["r0"]["token_ids"] == done["r1"]["token_ids"]  # greedy, same prompt
        assert "No supported WebSocket library" not in server.log()
    finally:
        server.stop()
