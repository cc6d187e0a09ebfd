"""`--kv-cache-dtype int8` on the embedded default model (SmolLM2-135M-Instruct, Q4_1): the
same greedy answer as tests/e2e/test_default_model.py asserts on its bfloat16 pages, through
the int8 write, prefill and decode kernels (and the C decode stack), pages back to zero; and a
model family that does not take int8 pages stops at start with the option named."""

from __future__ import annotations

import pytest

from tests.e2e.test_default_model import ask_capital_of_france
from tests.servers import MstarServer, serve_until_exit


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory):
    server = MstarServer("", tmp_path_factory.mktemp("logs") / "int8.log", "--num-kv-pages", "128",
                         "--kv-cache-dtype", "int8").start(timeout=300)
    yield server
    server.stop()


def test_default_model_on_int8_pages_answers_paris(int8_server):
    body = ask_capital_of_france(int8_server)
    assert "Paris" in body["text"], body["text"]
    assert body["finish_reason"] == "stop"


def test_a_family_without_int8_pages_stops_at_start():
    done = serve_until_exit("--kv-cache-dtype", "int8", "--task", "embed", timeout=120)
    assert done.returncode != 0
    assert "kv_cache_dtype int8" in done.stdout + done.stderr
