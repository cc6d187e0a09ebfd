"""Prompt-lookup speculation through the four services: greedy tokens equal
transformers' with drafts accepted and rejected along the way, several tokens reach the
client in one streamed delta, the counters show on /metrics, and pages come back."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.reference import hf_greedy, hf_ids
from tests.servers import REPO, MstarServer, service_env

PROMPTS = [
    "Hello world! Hello again, world. Goodbye, world. " * 4,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return",
    "one two three four five six one two three four five six one two three",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def spec_server(llama_ckpt, tmp_path_factory):
    server = MstarServer(str(llama_ckpt), tmp_path_factory.mktemp("logs") / "spec.log", "--num-kv-pages", "256",
                         "--page-size", "4", "--speculative-k", "4", "--speculative-ngram-min", "1").start()
    yield server
    server.stop()


def test_greedy_tokens_equal_transformers_with_speculation(spec_server, llama_ckpt):
    before = spec_server.metric("mstar_spec_accepted_tokens_total")
    for prompt in PROMPTS:
        r = httpx.post(spec_server.url + "/generate",
                       json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        ids = hf_ids(llama_ckpt, prompt)
        assert body["token_ids"] == hf_greedy(llama_ckpt, ids, 40), prompt
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 40}
    deadline = time.monotonic() + 5  # worker counters reach /metrics within a stats interval
    while ((accepted := spec_server.metric("mstar_spec_accepted_tokens_total")) <= before
           and time.monotonic() < deadline):
        time.sleep(0.1)
    assert spec_server.metric("mstar_spec_draft_tokens_total") > accepted > before  # some drafts stood, some did not


def test_streamed_deltas_carry_accepted_drafts(spec_server):
    deltas, done = [], None
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", spec_server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        done = events[-1]
        assert done["type"] == "done" and len(done["token_ids"]) == 40
        assert [t for e in events[:-1] for t in e["token_ids"]] == done["token_ids"]
        assert "".join(e["text"] for e in events[:-1]) == done["text"]
        plain = httpx.post(spec_server.url + "/generate", json=body, timeout=60).json()
        assert plain["token_ids"] == done["token_ids"] and plain["text"] == done["text"]
        deltas += events[:-1]
    assert max(len(e["token_ids"]) for e in deltas) > 1  # a verify step's tokens in one frame


def test_openai_text_and_usage_count_every_accepted_token(spec_server):
    name = httpx.get(spec_server.url + "/v1/models").json()["data"][0]["id"]
    body = {"prompt": PROMPTS[2], "max_tokens": 33, "temperature": 0, "ignore_eos": True}
    want = httpx.post(spec_server.url + "/generate", json=body, timeout=60).json()
    r = httpx.post(spec_server.url + "/v1/completions", json={"model": name, **body}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 33
    assert r.json()["choices"][0]["text"] == want["text"] and r.json()["choices"][0]["finish_reason"] == "length"


def test_out_of_range_speculation_flags_are_refused():
    for flags, message in [(["--speculative-k", "17"], "speculative_k must be in [0, 16], got 17"),
                           (["--speculative-ngram-min", "4"],
                            "speculative n-gram sizes need 1 <= speculative_ngram_min <= speculative_ngram_max <= 8, "
                            "got 4 and 3")]:
        proc = subprocess.run([sys.executable, "-m", "services.conductor", *flags], cwd=REPO, env=service_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        assert proc.stderr.strip() == f"invalid deployment: {message}"


def test_stop_strings_end_where_they_do_without_speculation(spec_server, llama_server):
    """A stop string completed inside a verify step's burst: same text, ids and usage as the
    server that decodes one token per step."""
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        full = httpx.post(llama_server.url + "/generate", json=body, timeout=60).json()["text"]
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        if not stop.strip():
            continue
        want = httpx.post(llama_server.url + "/generate", json={**body, "stop": stop}, timeout=60).json()
        got = httpx.post(spec_server.url + "/generate", json={**body, "stop": stop}, timeout=60).json()
        assert (got["text"], got["token_ids"], got["usage"], got["finish_reason"]) == \
            (want["text"], want["token_ids"], want["usage"], want["finish_reason"]), prompt
        assert want["finish_reason"] == "stop"
