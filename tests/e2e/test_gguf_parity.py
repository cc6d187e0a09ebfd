"""`mstar serve --model file.gguf` for the llama, qwen2, qwen3, gemma2, gemma3 and phi3 GGUF
architectures (Gemma's and Phi-3's checkpoints made as llama.cpp assumes them: see
`gguf_checkpoint_overrides`): greedy
tokens from /generate and usage.prompt_tokens equal transformers' on the HF checkpoint the
GGUF file was written from (llama.cpp's converter layout, F32 tensors)."""

from __future__ import annotations

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.gguf_files import gguf_checkpoint_overrides, llama3_tokenizer_variant, write_gguf
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer

# arch -> (checkpoint family, tokenizer.ggml.pre). The llama checkpoint gets Llama 3's
# tokenizer.json (Split regex, ignore_merges, BOS post-processor) for pre "llama-bpe".
ARCHS = {"llama": ("llama", "llama-bpe"), "qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen2"),
         "gemma2": ("gemma2", "gpt2"), "gemma3": ("gemma3", "gpt2"), "phi3": ("phi3", "gpt2")}

PROMPTS = [
    "The quick brown fox",
    "Numbers like 12345 and emoji 🎉 and 中文",
    "def add(a, b):\n    return",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=list(ARCHS))
def gguf_served(request, tmp_path_factory):
    """(HF checkpoint folder, server on the GGUF written from it): one server per arch."""
    arch = request.param
    family, pre = ARCHS[arch]
    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    ckpt = make_checkpoint(root / f"tiny-{arch}", family, **gguf_checkpoint_overrides(arch))
    if pre == "llama-bpe":
        llama3_tokenizer_variant(ckpt)
    gguf_path = write_gguf(ckpt, root / f"tiny-{arch}.gguf", arch, pre)
    server = MstarServer(str(gguf_path), root / f"{arch}.log", "--num-kv-pages", "256").start()
    yield ckpt, server
    server.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_gguf_greedy_matches_transformers(gguf_served, prompt):
    ckpt, server = gguf_served
    r = httpx.post(server.url + "/generate", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = hf_ids(ckpt, prompt)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["token_ids"] == hf_greedy(ckpt, ids, MAX_TOKENS)
