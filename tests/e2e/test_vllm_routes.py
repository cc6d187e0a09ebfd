"""What a vLLM user's tools expect, through real processes: `/tokenize`, `/detokenize`,
`/version`, `/openapi.json`, `max_model_len` on `/v1/models`, `mstar --version`, and `/metrics`' usage
counters, histograms and `model_name` labels (measured as deltas: the server is shared)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx

from shared.version import mstar_version
from tests.e2e.test_openai import GREEDY, MESSAGES, NO_EOS, _pick_stop, hf_chat_ids
from tests.reference import hf_ids, hf_tokenizer
from tests.servers import REPO, MstarServer, parse_labels

PROMPT = "Hello world! Numbers like 12345 and emoji 🎉"


def post(server: MstarServer, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def context_length(ckpt) -> int:
    return json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]


def test_tokenize_prompt_is_hf_ids(llama_server, llama_ckpt):
    body = post(llama_server, "/tokenize", {"prompt": PROMPT, "model": llama_ckpt.name})
    ids = hf_ids(llama_ckpt, PROMPT)
    assert body == {"count": len(ids), "max_model_len": context_length(llama_ckpt), "tokens": ids}
    assert post(llama_server, "/detokenize", {"tokens": ids})["prompt"] == PROMPT
    assert post(llama_server, "/detokenize", {"tokens": ids})["prompt"] == hf_tokenizer(str(llama_ckpt)).decode(ids)


def test_tokenize_messages_is_the_chat_prompt(client, llama_server, llama_ckpt):
    body = post(llama_server, "/tokenize", {"messages": MESSAGES})
    assert body["tokens"] == hf_chat_ids(llama_ckpt, MESSAGES)
    chat = client.chat.completions.create(model=llama_ckpt.name, messages=MESSAGES, max_tokens=2,
                                          extra_body={**GREEDY, **NO_EOS})
    assert body["count"] == chat.usage.prompt_tokens


def test_tokenize_and_detokenize_refusals(llama_server, llama_ckpt):
    r = httpx.post(llama_server.url + "/tokenize", json={"prompt": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = httpx.post(llama_server.url + "/tokenize", json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    vocab = hf_tokenizer(str(llama_ckpt)).vocab_size
    r = httpx.post(llama_server.url + "/detokenize", json={"tokens": [0, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert f"[0, {vocab - 1}]" in r.json()["error"]["message"]


def test_openapi_json_is_served(llama_server):
    """The document clients generate code from, with the POST routes' bodies."""
    r = httpx.get(llama_server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["version"] == mstar_version()
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"], path
    assert "max_tokens" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_models_show_max_model_len(client, llama_ckpt):
    models = client.models.list().data
    assert models[0].max_model_len == context_length(llama_ckpt)  # an extra field the client keeps
    assert client.models.retrieve(llama_ckpt.name).max_model_len == context_length(llama_ckpt)


def test_version(llama_server):
    assert httpx.get(llama_server.url + "/version").json() == {"version": mstar_version()}
    for argv in (["--version"], ["serve", "--version"]):
        out = subprocess.run([sys.executable, "-m", "services.launcher", *argv], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == f"mstar {mstar_version()}", out


COUNTED = ("mstar_prompt_tokens_total", "mstar_generation_tokens_total", "mstar_e2e_request_latency_seconds_count",
           "mstar_request_queue_time_seconds_count", "mstar_ttft_seconds_count")


def _generate_stream_usage(server: MstarServer, body: dict) -> dict:
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1]["type"] == "done"
    return events[-1]["usage"]


def test_usage_counters_and_histograms(client, llama_server, llama_ckpt):
    model = llama_ckpt.name
    before = {name: llama_server.metric(name) for name in COUNTED}
    finished = {r: llama_server.metric("mstar_request_success_total", f'{{finished_reason="{r}"}}')
                for r in ("stop", "length")}
    extra = {**GREEDY, **NO_EOS}
    usages = [client.completions.create(model=model, prompt=PROMPT, max_tokens=5, extra_body=extra).usage,
              client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, extra_body=extra).usage]
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES[:2], max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra))
    usages.append(chunks[-1].usage)
    usages = [{"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens} for u in usages]
    usages.append(post(llama_server, "/generate", {"prompt": "Once upon", "max_tokens": 6, **extra})["usage"])
    usages.append(_generate_stream_usage(llama_server, {"prompt": "Once upon a time", "max_tokens": 7, **extra}))
    # a stop string ends one request with finish_reason stop
    full = post(llama_server, "/generate", {"prompt": PROMPT, "max_tokens": 30, **extra})
    stopped = post(llama_server, "/generate", {"prompt": PROMPT, "max_tokens": 30, "stop": [_pick_stop(full["text"])],
                                               **extra})
    assert stopped["finish_reason"] == "stop"
    usages += [full["usage"], stopped["usage"]]

    after = {name: llama_server.metric(name) for name in COUNTED}
    delta = {name: after[name] - before[name] for name in COUNTED}
    assert delta["mstar_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert delta["mstar_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    n = len(usages)
    assert delta["mstar_e2e_request_latency_seconds_count"] == n
    assert delta["mstar_request_queue_time_seconds_count"] == n
    assert delta["mstar_ttft_seconds_count"] == n
    reasons = {r: llama_server.metric("mstar_request_success_total", f'{{finished_reason="{r}"}}') - finished[r]
               for r in finished}
    assert reasons == {"stop": 1, "length": n - 1}


def test_every_series_has_model_name(llama_server, llama_ckpt):
    text = httpx.get(llama_server.url + "/metrics").text
    samples = re.findall(r"^(mstar_[a-z0-9_]+)(\{[^}]*\})? ", text, re.M)
    names = {name for name, _ in samples}
    assert {"mstar_kv_cache_usage_ratio", "mstar_request_success_total", "mstar_requests_total",
            "mstar_e2e_request_latency_seconds_bucket", "mstar_request_queue_time_seconds_sum",
            "mstar_kv_pages_used", "mstar_requests_running"} <= names
    unlabelled = [name + labels for name, labels in samples
                  if parse_labels(labels).get("model_name") != llama_ckpt.name]
    assert not unlabelled, unlabelled
    assert 0.0 <= llama_server.metric("mstar_kv_cache_usage_ratio") <= 1.0


def test_stats_line_in_the_api_log(llama_ckpt, tmp_path):
    """A stats line as vLLM logs it, every MSTAR_LOG_STATS_S while there is traffic."""
    server = MstarServer(str(llama_ckpt), tmp_path / "stats.log", "--num-kv-pages", "64",
                         env={"MSTAR_LOG_STATS_S": "0.5"}).start()
    try:
        post(server, "/generate", {"prompt": PROMPT, "max_tokens": 40, **GREEDY, **NO_EOS})
        pattern = re.compile(r"Avg prompt throughput: [0-9.]+ tokens/s, Avg generation throughput: ([0-9.]+) tokens/s, "
                             r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [0-9.]+%, "
                             r"Prefix cache hit rate: [0-9.]+%")
        deadline = time.monotonic() + 10
        while not pattern.search(server.log()) and time.monotonic() < deadline:
            time.sleep(0.2)
        lines = pattern.findall(server.log())
        assert lines and any(float(g) > 0 for g in lines), server.log()[-3000:]
        time.sleep(1.5)  # idle: one line of zeros at most, then silence
        n = len(pattern.findall(server.log()))
        time.sleep(1.5)
        assert len(pattern.findall(server.log())) == n
    finally:
        server.stop()
