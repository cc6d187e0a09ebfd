"""Shared fixtures: small random checkpoints (made once per session) and running servers."""

from __future__ import annotations

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
