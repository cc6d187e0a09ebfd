"""Shared fixtures: small random checkpoints (made once per session) and running servers."""

from __future__ import annotations

import openai
import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    """Llama with tied embeddings and grouped KV heads (4 query heads, 2 KV heads)."""
    return make_checkpoint(tmp_path_factory.mktemp("llama") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory):
    """Qwen2 with q/k/v biases and an untied lm_head."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session")
def llama_server(llama_ckpt, tmp_path_factory):
    from tests.servers import MstarServer

    server = MstarServer(str(llama_ckpt), tmp_path_factory.mktemp("logs") / "llama.log", "--num-kv-pages", "256",
                         "--page-size", "4").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def slow_server(tmp_path_factory):
    """A wider and deeper random Llama (hidden 512, 8 layers) whose 400 tokens take seconds on
    a CPU, where the tiny one makes them in well under one: for tests that need a request
    still running when they look (tests/e2e/test_disconnect.py, test_api_limits.py). Its
    2048 positions and pool of 2048 rows let one request hold the whole pool."""
    from tests.servers import MstarServer

    ckpt = make_checkpoint(tmp_path_factory.mktemp("slow") / "slow-llama", "llama", hidden_size=512,
                           intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=2048)
    server = MstarServer(str(ckpt), tmp_path_factory.mktemp("logs") / "slow.log", "--num-kv-pages", "512",
                         "--page-size", "4").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen2_server(qwen2_ckpt, tmp_path_factory):
    from tests.servers import MstarServer

    server = MstarServer(str(qwen2_ckpt), tmp_path_factory.mktemp("logs") / "qwen2.log",
                         "--num-kv-pages", "256").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm_server(tmp_path_factory):
    """The embedded default model (SmolLM2-135M-Instruct), served once for the session."""
    from tests.servers import MstarServer

    server = MstarServer("", tmp_path_factory.mktemp("logs") / "smollm.log", "--num-kv-pages", "128").start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def pages_back_to_zero(request):
    """After every test that used a server, its pools' used pages are back to zero."""
    yield
    from tests.servers import MstarServer

    for value in list(request.node.funcargs.values()):
        if isinstance(value, MstarServer) and value.proc is not None and value.proc.poll() is None:
            assert value.wait_pages_free() == 0, "KV pages left in use after the test"


@pytest.fixture()
def client(llama_server) -> openai.OpenAI:
    """The official openai client on the shared Llama server (modules with another server override it)."""
    return openai.OpenAI(base_url=llama_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture()
def model(llama_ckpt) -> str:
    """The served model name of the shared Llama server."""
    return llama_ckpt.name


@pytest.fixture
def restore_threads():
    """The C kernels' thread count as it was before the test (a test that sets it)."""
    from services.gpu_worker.layers import quant

    before = quant.threads()
    yield
    quant.set_threads(before)
