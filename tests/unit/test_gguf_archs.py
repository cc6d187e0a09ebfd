"""GGUF files of the llama, qwen2 and qwen3 architectures (written from small random HF
checkpoints as llama.cpp's converter writes them) load back into the checkpoint's exact
tensors, config and token ids; unknown architectures, pre-tokenizers and rope scalings
are refused by name; the config and tokenizer paths never import torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata

import pytest

from tests.checkpoints import make_checkpoint
from tests.gguf_files import llama3_tokenizer_variant, write_gguf
from tests.servers import REPO

# case -> (checkpoint family, GGUF arch, tokenizer.ggml.pre, make_checkpoint overrides)
CASES = {
    "llama-gpt2": ("llama", "llama", "gpt2", {}),
    "llama-llama-bpe": ("llama", "llama", "llama-bpe", {}),
    "qwen2-qwen2": ("qwen2", "qwen2", "qwen2", {}),
    "qwen3-qwen2": ("qwen3", "qwen3", "qwen2", {}),
}
# A llama file with q/k biases (attention_bias): they are permuted like the weights.
WEIGHT_CASES = [*CASES, "llama-bias"]
_ALL = {**CASES, "llama-bias": ("llama", "llama", "gpt2", {"attention_bias": True})}

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers like 12345 and 3.14159, or 9876543210.",
    "don't I'll we've they're it's I'M YOU'LL she'd",
    "emoji 🎉🚀 and 中文字符 and 日本語のテキスト",
    "line one\nline two\r\n\n\nline five\n",
    "multiple   spaces    here  \t tab and trailing   ",
    "def add(a, b):\n    return a + b  # café e\u0301 naïve",
    "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> (HF checkpoint folder, GGUF path), made lazily once per module."""
    root = tmp_path_factory.mktemp("gguf_archs")
    made: dict = {}

    def get(case: str):
        if case not in made:
            family, arch, pre, overrides = _ALL[case]
            ckpt = make_checkpoint(root / case, family, **overrides)
            if pre == "llama-bpe":
                llama3_tokenizer_variant(ckpt)
            made[case] = ckpt, write_gguf(ckpt, root / f"{case}.gguf", arch, pre)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_tokenizer_matches_hf(files, case):
    from tokenizers import Tokenizer

    from shared.gguf_source import load_gguf_tokenizer

    ckpt, path = files(case)
    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    info = load_gguf_tokenizer(path)
    # The pieces themselves, not only the ids: this tiny vocab has no multi-digit tokens
    # for the qwen families, so a wrong digit rule would not show in their ids.
    mine = json.loads(info.tokenizer.to_str())
    ref = json.loads(hf.to_str())
    assert mine["model"]["ignore_merges"] == ref["model"]["ignore_merges"]
    assert mine["normalizer"] is None  # llama.cpp normalizes nothing (Qwen's tokenizer.json NFC-normalizes)
    for text in TEXTS:
        if unicodedata.normalize("NFC", text) != text and hf.normalizer is not None:
            continue  # non-NFC text: llama.cpp (and llama-server's /tokenize) keeps it as is
        norm = hf.normalizer.normalize_str(text) if hf.normalizer else text
        assert info.tokenizer.pre_tokenizer.pre_tokenize_str(norm) == hf.pre_tokenizer.pre_tokenize_str(norm), text
        for special in (True, False):
            got = info.tokenizer.encode(text, add_special_tokens=special).ids
            assert got == hf.encode(text, add_special_tokens=special).ids, (text, special)
        ids = hf.encode(text, add_special_tokens=False).ids
        assert info.tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert info.eos_token == "<|im_end|>" and info.eos_token_id == hf.token_to_id("<|im_end|>")
    assert info.pad_token_id == hf.token_to_id("<|endoftext|>")
    assert info.chat_template and "<|im_start|>" in info.chat_template
    if CASES[case][2] == "llama-bpe":  # Llama 3 style: BOS added by the post-processor
        assert info.add_bos_token and info.bos_token == "<|im_start|>"
    else:
        assert not info.add_bos_token and info.bos_token_id is None


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_weights_equal_checkpoint(files, case):
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from services.gpu_worker.gguf_weights import load_gguf_weights

    ckpt, path = files(case)
    want = load_file(str(ckpt / "model.safetensors"))
    config, got = load_gguf_weights(path, progress=False)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert isinstance(got[name], np.ndarray) and got[name].flags.writeable and got[name].flags.c_contiguous, name
        assert got[name].dtype == np.float32 and torch.equal(torch.from_numpy(got[name]), tensor), name
    if case == "llama-bias":
        assert config["attention_bias"] and "model.layers.0.self_attn.q_proj.bias" in got


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_config(files, case):
    from shared.gguf_source import gguf_config

    family, arch, _, _ = _ALL[case]
    ckpt, path = files(case)
    hf = json.loads((ckpt / "config.json").read_text())
    cfg = gguf_config(path)
    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert cfg["architectures"] == [arch_name] == hf["architectures"]
    assert cfg["model_type"] == arch == hf["model_type"]
    assert cfg["head_dim"] == {"qwen3": 32}.get(family, 16)
    assert cfg["tie_word_embeddings"] is (family == "llama") is hf["tie_word_embeddings"]
    assert cfg["attention_bias"] is (family == "qwen2" or case == "llama-bias")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "rms_norm_eps",
                "eos_token_id", "pad_token_id", "bos_token_id"):
        assert cfg[key] == hf[key], key
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["num_key_value_heads"] == 2 and cfg["rms_norm_eps"] == 1e-6


@pytest.mark.parametrize("scaling, want", [
    ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
])
def test_rope_scaling(files, tmp_path, scaling, want):
    from shared.gguf_source import gguf_config

    ckpt, _ = files("qwen2-qwen2")
    path = write_gguf(ckpt, tmp_path / "scaled.gguf", "qwen2", "qwen2", rope_scaling=scaling)
    assert gguf_config(path)["rope_scaling"] == want


def test_rope_freqs_serve_llama31_scaling(tmp_path):
    """A Llama 3.1-style file: llama.cpp's converter turns the llama3 rope scaling into the
    `rope_freqs` divisors; served as they are, the logits equal transformers' on the HF
    checkpoint with its llama3 scaling."""
    import torch

    from services.gpu_worker.attention import build_metadata
    from services.gpu_worker.kv_memory import kv_cache
    from services.gpu_worker.weights import build_model
    from shared.gguf_source import gguf_config
    from shared.model_source import ModelSource
    from tests.reference import hf_model

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    ckpt = make_checkpoint(tmp_path / "llama31", "llama", rope_parameters=scaling)
    path = write_gguf(ckpt, tmp_path / "llama31.gguf", "llama", "gpt2", rope_freqs=True, rope_scaling={})
    assert gguf_config(path)["rope_scaling"]["rope_type"] == "freq_factors"
    src = ModelSource(str(path))
    spec = src.spec(16)
    model = build_model(src, spec, torch.float32)
    pool = next(iter(spec.paged_pools(32).values()))
    caches = kv_cache(pool.num_layers, pool.num_pages, 16, pool.kv_heads, pool.head_dim, torch.float32,
                      torch.device("cpu"))
    ids = [(7 * j) % 200 + 3 for j in range(300)]  # positions well past the original context
    meta = build_metadata([(list(range(19)), 0, 0, len(ids), False)], 16)
    with torch.no_grad():
        ours = model(torch.tensor(ids), torch.arange(len(ids)), caches, [meta] * len(caches),
                     torch.arange(len(ids)))
        ref = hf_model(str(ckpt))(torch.tensor([ids])).logits[0]
    # (the divisors are float32, rounded once more than transformers' smoothing formula: 1e-4
    # of logits at position 300; without them the logits differ by whole units)
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=5e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_unknown_architecture_refused(files, tmp_path):
    from services.gpu_worker.gguf_weights import load_gguf_weights
    from shared.gguf_source import gguf_config

    ckpt, _ = files("llama-gpt2")
    path = write_gguf(ckpt, tmp_path / "other.gguf", "llama", "gpt2", general_architecture="mamba")
    for load in (gguf_config, load_gguf_weights):
        with pytest.raises(NotImplementedError, match=r"'mamba'.*llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3"):
            load(path)


def test_unknown_pre_tokenizer_refused(files, tmp_path):
    from shared.gguf_source import load_gguf_tokenizer

    ckpt, _ = files("qwen2-qwen2")
    path = write_gguf(ckpt, tmp_path / "other_pre.gguf", "qwen2", "no-such-pre")
    with pytest.raises(NotImplementedError, match=r"'no-such-pre'.*qwen2"):
        load_gguf_tokenizer(path)


def test_config_and_tokenizer_do_not_import_torch(files):
    _, path = files("qwen3-qwen2")
    code = (
        "import sys\n"
        "from shared.gguf_source import gguf_config, load_gguf_tokenizer\n"
        f"cfg = gguf_config({str(path)!r})\n"
        f"tok = load_gguf_tokenizer({str(path)!r})\n"
        "assert cfg['architectures'] == ['Qwen3ForCausalLM'], cfg\n"
        "assert tok.tokenizer.encode('Hello world').ids\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("service", ["conductor", "data_worker", "gpu_worker", "api"])
def test_unsupported_architecture_is_one_line_before_start(files, tmp_path, service):
    """Each service alone, and `mstar check`, refuse an unserved GGUF architecture in one
    line naming it and the served ones, exit 2, no traceback."""
    ckpt, _ = files("llama-gpt2")
    path = write_gguf(ckpt, tmp_path / "other.gguf", "llama", "gpt2", general_architecture="mamba")
    want = "unsupported GGUF architecture 'mamba'; supported: llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3"
    for argv in [[f"services.{service}"]] + ([["services.launcher", "check"]] if service == "conductor" else []):
        out = subprocess.run([sys.executable, "-m", *argv, "--model", str(path)], capture_output=True, text=True,
                             cwd=REPO, timeout=120, env={**os.environ, "MSTAR_GGUF_CACHE": str(tmp_path / "c")})
        assert out.returncode == 2, (argv, out.stderr[-2000:])
        assert want in out.stderr + out.stdout and "Traceback" not in out.stderr, (argv, out.stderr[-2000:])
