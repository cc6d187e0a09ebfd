"""vLLM's `/tokenize`, `/detokenize`, `/version` in-process (request and reply shapes, 400s),
`max_model_len` on `/v1/models`, and the metrics a vLLM user's dashboards read: usage
counters, finish reasons, e2e and queue-time histograms, KV use, `model_name` on every
series, and the periodic stats line."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from starlette.testclient import TestClient
from tokenizers import Tokenizer, processors

from services.api.app import create_app
from services.api.backend import RequestHandle
from services.api.chat_template import ChatTemplate
from services.api.generation import Generation
from services.api.metrics import ApiMetrics
from services.api.stats_log import Snapshot, busy, stats_line
from shared.detokenize import IncrementalDetokenizer
from shared.frames import ClusterStatus, Output, PoolStats, WorkerStats
from shared.model_source import TokenizerBundle
from shared.version import mstar_version
from tests.checkpoints import CHAT_TEMPLATE, make_tokenizer
from tests.unit.test_api_openai import MODEL, make_settings
from tests.unit.test_api_validation import tiny_tokenizer

MAX_LEN = 96
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world, again"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A trained byte-level BPE whose post-processor adds a BOS (`<|endoftext|>`), so
    `add_special_tokens` shows."""
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>",
                                                                                                    bos)])
    return tok


@pytest.fixture()
def client(tmp_path, tokenizer):
    bundle = TokenizerBundle(tokenizer, CHAT_TEMPLATE, [0])
    with TestClient(create_app(make_settings(tmp_path, max_model_len=MAX_LEN), bundle)) as c:
        yield c


def post(client: TestClient, path: str, body: object) -> tuple[int, dict]:
    r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return r.status_code, r.json()


def chat_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    return ChatTemplate(CHAT_TEMPLATE).render(messages, add_generation_prompt=add_generation_prompt)


# ---- /tokenize -----------------------------------------------------------------------------


def test_tokenize_prompt(client: TestClient, tokenizer: Tokenizer) -> None:
    status, body = post(client, "/tokenize", {"prompt": "Hello world", "model": MODEL})
    ids = tokenizer.encode("Hello world").ids
    assert status == 200 and body == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids}
    assert list(body) == ["count", "max_model_len", "tokens"]  # vLLM's order
    assert ids[0] == tokenizer.token_to_id("<|endoftext|>")  # the BOS, added by default
    status, body = post(client, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert body["tokens"] == ids[1:] and body["count"] == len(ids) - 1
    status, body = post(client, "/tokenize", {"prompt": "Hello", "return_token_strs": True})
    assert body["token_strs"] == [tokenizer.id_to_token(i) for i in body["tokens"]]
    assert post(client, "/tokenize", {"prompt": ""})[1]["tokens"] == ids[:1]  # an empty prompt is fine


def test_tokenize_messages_is_the_chat_prompt(client: TestClient, tokenizer: Tokenizer) -> None:
    status, body = post(client, "/tokenize", {"messages": MESSAGES})
    ids = tokenizer.encode(chat_text(MESSAGES), add_special_tokens=False).ids  # as the chat route sends it
    assert status == 200 and body == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids}
    _, body = post(client, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert body["tokens"] == tokenizer.encode(chat_text(MESSAGES, False), add_special_tokens=False).ids
    assert len(body["tokens"]) < len(ids)
    _, body = post(client, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True})
    assert body["tokens"] == [tokenizer.token_to_id("<|endoftext|>"), *ids]
    # continue_final_message: the text ends right after the last message's content
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure, here"}]
    _, body = post(client, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                         "continue_final_message": True})
    text = chat_text(prefill, False)
    want = text[:text.rindex("Sure, here") + len("Sure, here")]
    assert body["tokens"] == tokenizer.encode(want, add_special_tokens=False).ids


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"prompt": "x", "foo": 1}, 400, "foo",
         "unknown field 'foo' with prompt; allowed fields: add_special_tokens, model, prompt, return_token_strs"),
        ({"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt", None),
        ({"messages": MESSAGES, "tools": []}, 400, "tools", None),
        ({"messages": MESSAGES, "prompt": "x"}, 400, "messages", "give prompt or messages, not both"),
        ({}, 400, "prompt", "prompt is required: a string (or give messages)"),
        ({"prompt": 5}, 400, "prompt", "prompt must be a string (or give messages), got 5"),
        ({"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", None),
        ({"prompt": "x", "model": "other"}, 404, "model", None),
        ({"prompt": "x", "model": 3}, 400, "model", "model must be a string, got 3"),
        ({"messages": []}, 400, "messages", None),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id", None),
        ({"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message", None),
    ],
)
def test_tokenize_refusals(client: TestClient, body: dict, status: int, param: str, message: str | None) -> None:
    got, reply = post(client, "/tokenize", body)
    assert (got, reply["error"]["param"]) == (status, param), reply
    if message is not None:
        assert reply["error"]["message"] == message
    if status == 404:
        assert reply["error"]["code"] == "model_not_found"


def test_tokenize_messages_without_a_template(tmp_path) -> None:
    with TestClient(create_app(make_settings(tmp_path), tiny_tokenizer())) as c:
        status, body = post(c, "/tokenize", {"messages": MESSAGES})
    assert status == 400 and body["error"]["param"] == "messages" and "no chat template" in body["error"]["message"]


def test_tokenize_bad_json_and_size(client: TestClient) -> None:
    r = client.post("/tokenize", content=b"[1]")
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body must be a JSON object, got an array"
    assert post(client, "/tokenize", {"prompt": "x" * 5000})[0] == 413
    assert client.get("/tokenize").status_code == 405


# ---- /detokenize ---------------------------------------------------------------------------


def test_detokenize_round_trip(client: TestClient, tokenizer: Tokenizer) -> None:
    _, tok = post(client, "/tokenize", {"prompt": "Hello world, again", "add_special_tokens": False})
    status, body = post(client, "/detokenize", {"tokens": tok["tokens"], "model": MODEL})
    assert status == 200 and body == {"prompt": "Hello world, again"}
    _, tok = post(client, "/tokenize", {"messages": MESSAGES})
    assert post(client, "/detokenize", {"tokens": tok["tokens"]})[1]["prompt"] == chat_text(MESSAGES)  # specials kept
    assert post(client, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def test_detokenize_refusals(client: TestClient, tokenizer: Tokenizer) -> None:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    status, body = post(client, "/detokenize", {"tokens": [1, vocab]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert body["error"]["message"] == (f"tokens[1] is {vocab}; token ids must be integers in [0, {vocab - 1}] "
                                        f"(the vocabulary has {vocab} tokens)")
    status, body = post(client, "/detokenize", {"tokens": [-1]})
    assert status == 400 and body["error"]["param"] == "tokens" and str(vocab - 1) in body["error"]["message"]
    for bad in ([True], [1.5], ["a"]):  # not an integer: the element is named
        status, body = post(client, "/detokenize", {"tokens": bad})
        assert (status, body["error"]["param"]) == (400, "tokens[0]")
        assert body["error"]["message"] == f"tokens[0] must be an integer, got {json.dumps(bad[0])}"
    for body_in, param in (({"tokens": "1 2"}, "tokens"), ({}, "tokens"), ({"tokens": [1], "prompt": "x"}, "prompt"),
                           ({"tokens": [1], "model": "other"}, "model")):
        status, body = post(client, "/detokenize", body_in)
        assert status in (400, 404) and body["error"]["param"] == param, body


# ---- /version, /v1/models --------------------------------------------------------------------


def test_version_and_model_card(client: TestClient) -> None:
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": mstar_version()} and mstar_version() != "unknown"
    card = client.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_LEN and client.get(f"/v1/models/{MODEL}").json()["max_model_len"] == MAX_LEN


# ---- metrics -------------------------------------------------------------------------------


class FakeBackend:
    def abort(self, request_id: str, reason: str = "abort") -> None:
        pass


def series(text: str) -> dict[str, float]:
    """Every sample line of a /metrics body: `name{labels}` -> value."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(mstar_\S+) (\S+)$", text, re.M)}


async def _run(metrics: ApiMetrics, rid: str, frames: list[Output], dispatched: bool = True) -> None:
    tok = tiny_tokenizer()
    tok.add_tokens(["a", "b", "c"])
    handle = RequestHandle(rid, FakeBackend())  # type: ignore[arg-type]
    if dispatched:
        handle.dispatched_at = 0.5
    gen = Generation(handle, IncrementalDetokenizer(tok), metrics, client_id=rid, started=0.0)
    for out in frames:
        handle.put(out)
    await gen.collect()
    gen.close()


async def test_finished_requests_feed_usage_reasons_and_histograms() -> None:
    m = ApiMetrics("served")
    await _run(m, "r1", [Output("r1", [1, 2], None, 5), Output("r1", [3], "length", 5)])
    await _run(m, "r2", [Output("r2", [1], "stop", 7)], dispatched=False)
    text = m.render().decode()
    s = series(text)
    assert s['mstar_prompt_tokens_total{model_name="served"}'] == 12
    assert s['mstar_generation_tokens_total{model_name="served"}'] == 4
    assert s['mstar_request_success_total{finished_reason="length",model_name="served"}'] == 1
    assert s['mstar_request_success_total{finished_reason="stop",model_name="served"}'] == 1
    assert s['mstar_request_success_total{finished_reason="abort",model_name="served"}'] == 0
    assert s['mstar_requests_total{model_name="served",status="ok"}'] == 2
    assert s['mstar_e2e_request_latency_seconds_count{model_name="served"}'] == 2
    # r1: from arrival to its Dispatched frame; r2 (outputs outran Dispatched): to its first token
    assert s['mstar_request_queue_time_seconds_count{model_name="served"}'] == 2
    assert s['mstar_request_queue_time_seconds_bucket{le="0.1",model_name="served"}'] == 0
    assert s['mstar_ttft_seconds_count{model_name="served"}'] == 2 and s['mstar_itl_seconds_count{model_name="served"}']
    assert m.window.prompt_tokens == 12 and m.window.generation_tokens == 4  # counted once per request


async def test_a_client_that_leaves_is_an_abort_with_its_usage() -> None:
    m = ApiMetrics("served")
    tok = tiny_tokenizer()
    handle = RequestHandle("r", FakeBackend())  # type: ignore[arg-type]
    gen = Generation(handle, IncrementalDetokenizer(tok), m, client_id="r", started=0.0)
    handle.put(Output("r", [1, 2], None, 4))
    events = gen.events()
    await anext(events)
    gen.close()  # the client went away
    gen.close()  # once only
    s = series(m.render().decode())
    assert s['mstar_request_success_total{finished_reason="abort",model_name="served"}'] == 1
    assert s['mstar_requests_total{model_name="served",status="abort"}'] == 1
    assert s['mstar_prompt_tokens_total{model_name="served"}'] == 4
    assert s['mstar_generation_tokens_total{model_name="served"}'] == 2
    await asyncio.sleep(0)


def cluster(used: tuple[int, int], running: int = 1, waiting: int = 0, hits: int = 0, queued: int = 1) -> ClusterStatus:
    """One worker with two pools; `queued` requests wait at the conductor."""
    pools = [PoolStats("kv", 100, 100 - used[0]), PoolStats("kv_window", 60, 60 - used[1])]
    return ClusterStatus(1, [WorkerStats("w0", pools, running, waiting, prefix_hit_tokens=hits)], waiting=queued)


def test_every_series_has_model_name_and_kv_usage() -> None:
    m = ApiMetrics("served")
    m.set_cluster_status(cluster((30, 10)))
    text = m.render().decode()
    samples = series(text)
    assert samples['mstar_kv_cache_usage_ratio{model_name="served"}'] == 0.25  # 40 of 160 pages
    assert samples['mstar_kv_pages_used{model_name="served",pool="kv"}'] == 30
    names = {re.sub(r"\{.*", "", k) for k in samples}
    assert {"mstar_prompt_tokens_total", "mstar_generation_tokens_total", "mstar_e2e_request_latency_seconds_count",
            "mstar_request_queue_time_seconds_count", "mstar_request_success_total", "mstar_requests_total",
            "mstar_ttft_seconds_count", "mstar_itl_seconds_count", "mstar_requests_running",
            "mstar_requests_waiting", "mstar_kv_footprint_overruns_total", "mstar_kv_pages_total"} <= names
    unlabelled = [k for k in samples if 'model_name="served"' not in k]
    assert not unlabelled, unlabelled


def test_stats_line() -> None:
    prev = Snapshot(0.0, 100, 50, 0)
    cur = Snapshot(10.0, 300, 150, 50)
    line = stats_line(prev, cur, cluster((30, 10), running=3, waiting=2, hits=50))
    assert line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 3 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    idle = Snapshot(20.0, 300, 150, 50)
    assert busy(prev, cur, None) and busy(cur, idle, cluster((0, 0), running=1, queued=0))
    assert not busy(cur, idle, cluster((0, 0), running=0, queued=0))


def test_stats_line_without_status() -> None:
    line = stats_line(Snapshot(0.0, 0, 0, None), Snapshot(10.0, 10, 0, None), None)
    assert line.endswith("Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
