"""Greedy tokens from /generate equal transformers' greedy tokens for the same checkpoint,
and usage.prompt_tokens equals transformers' tokenization."""

from __future__ import annotations

import httpx
import pytest

from tests.reference import hf_greedy, hf_ids

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "def add(a, b):\n    return",
    "Numbers like 12345 and emoji 🎉 and 中文",
    "Hello world! Hello again, world. Goodbye, world. " * 6,  # crosses many pages
]


@pytest.mark.parametrize("server_name", ["llama_server", "qwen2_server"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(request, server_name, prompt):
    server = request.getfixturevalue(server_name)
    ckpt = request.getfixturevalue(server_name.replace("server", "ckpt"))
    r = httpx.post(server.url + "/generate",
                   json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = hf_ids(ckpt, prompt)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12}
    assert body["token_ids"] == hf_greedy(ckpt, ids, 12)
    assert body["finish_reason"] == "length"


def test_input_ids_match_transformers(llama_server, llama_ckpt):
    ids = hf_ids(llama_ckpt, "Serving engines batch requests")
    r = httpx.post(llama_server.url + "/generate",
                   json={"input_ids": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == hf_greedy(llama_ckpt, ids, 20)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
