"""The checkpoint's generation_config.json is the model's default sampling on every route
(issue 48), through the real services: a random Llama whose file says greedy and 6 new
tokens answers a request that leaves them out greedily with 6 tokens, exactly as the same
request that sets them; a request's own value wins; /v1/models and the log say which
defaults are in force."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.checkpoints import make_checkpoint
from tests.servers import MstarServer

ASK = [{"role": "user", "content": "Tell me about the sea"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("genconfig")
    ckpt = make_checkpoint(folder / "tiny-llama", "llama")
    config = json.loads((ckpt / "generation_config.json").read_text())  # what save_pretrained wrote
    config.update({"do_sample": False, "temperature": 0.9, "max_new_tokens": 6})
    (ckpt / "generation_config.json").write_text(json.dumps(config))
    server = MstarServer(str(ckpt), folder / "log.txt", "--num-kv-pages", "128").start()
    yield server, ckpt.name
    server.stop()


def test_models_and_the_log_say_which_defaults_are_in_force(served):
    server, _ = served
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["default_sampling"] == {"temperature": 0.0, "max_tokens": 6}
    assert "default sampling from auto: temperature=0.0, max_tokens=6" in server.log()


def test_left_out_fields_take_the_files_defaults(served):
    server, name = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    default = client.chat.completions.create(model=name, messages=ASK)
    explicit = client.chat.completions.create(model=name, messages=ASK, temperature=0.0, max_tokens=6)
    assert default.choices[0].message.content == explicit.choices[0].message.content
    assert default.usage.completion_tokens == explicit.usage.completion_tokens <= 6
    body = {"prompt": "the sea", "ignore_eos": True}
    got = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    same = httpx.post(server.url + "/generate", json={**body, "temperature": 0.0, "max_tokens": 6}, timeout=60).json()
    assert got["token_ids"] == same["token_ids"] and len(got["token_ids"]) == 6
    assert got["finish_reason"] == "length"


def test_the_requests_own_values_win(served):
    server, _ = served
    body = {"prompt": "the sea", "ignore_eos": True}
    longer = httpx.post(server.url + "/generate", json={**body, "max_tokens": 9}, timeout=60).json()
    assert len(longer["token_ids"]) == 9
    sampled = [httpx.post(server.url + "/generate", json={**body, "temperature": 1.0, "seed": s}, timeout=60).json()
               for s in range(4)]
    assert len({tuple(r["token_ids"]) for r in sampled}) > 1  # sampled, not the file's greedy
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": "the sea", "ignore_eos": True},
                            timeout=60).json()
    assert completion["usage"]["completion_tokens"] == 16  # OpenAI's documented default, as vLLM keeps it
