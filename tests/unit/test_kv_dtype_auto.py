"""`--kv-cache-dtype auto`: bfloat16 pages for a GGUF file with quantized matrices on the
CPU (--dtype auto), float32 for float checkpoints (safetensors, a GGUF of F32 tensors: their
exact-parity paths), the weights' dtype where --dtype names one, an explicit value always."""

from __future__ import annotations

import pytest

from shared.config import Deployment, kv_dtype
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf


@pytest.fixture(autouse=True)
def cpu(monkeypatch):
    monkeypatch.setenv("MSTAR_DEVICE", "cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvdtype")
    ckpt = make_checkpoint(root / "ckpt", "llama")
    f32 = write_gguf(ckpt, root / "f32.gguf", "llama", "gpt2")
    q = write_gguf(ckpt, root / "q.gguf", "llama", "gpt2", qtypes={"ffn_up.weight": "Q4_1"})
    return ckpt, f32, q


def test_default_model_gets_bfloat16_pages():
    assert kv_dtype(Deployment()) == "bfloat16"


def test_quantized_gguf_bfloat16_float_files_float32(files):
    ckpt, f32, q = files
    assert kv_dtype(Deployment(model=str(q))) == "bfloat16"
    assert kv_dtype(Deployment(model=str(f32))) == "float32"
    assert kv_dtype(Deployment(model=str(ckpt))) == "float32"
    assert kv_dtype(Deployment(model="null")) == "float32"


def test_dtype_or_explicit_kv_dtype_wins(files):
    _, _, q = files
    assert kv_dtype(Deployment(model=str(q), dtype="float32")) == "float32"
    assert kv_dtype(Deployment(model=str(q), dtype="float16")) == "float16"
    assert kv_dtype(Deployment(model=str(q), kv_cache_dtype="float32")) == "float32"
    assert kv_dtype(Deployment(model=str(files[0]), kv_cache_dtype="bfloat16")) == "bfloat16"


def test_cuda_keeps_float32(files, monkeypatch):
    """On CUDA a GGUF is computed dequantized in float32 (FlashInfer plans one dtype)."""
    monkeypatch.setenv("MSTAR_DEVICE", "cuda")
    assert kv_dtype(Deployment(model=str(files[2]))) == "float32"


def test_unreadable_model_is_not_refused_here():
    assert kv_dtype(Deployment(model="/no/such/model.gguf")) == "float32"
