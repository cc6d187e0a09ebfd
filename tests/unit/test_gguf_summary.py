"""The GGUF summary (shared/gguf_source.py): parsed once, kept in a cache file, and every
process's config, tokenizer and weights from it are what the reader gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from services.gpu_worker import gguf_weights as gw
from shared import gguf_source as g
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_GGUF_CACHE", str(tmp_path / "cache"))
    g._summary.cache_clear()
    yield tmp_path / "cache"
    g._summary.cache_clear()


@pytest.fixture(scope="module")
def quantized_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("summary")
    ckpt = make_checkpoint(root / "ckpt", "llama")
    return write_gguf(ckpt, root / "m.gguf", "llama", "gpt2", qtypes={"ffn_up.weight": "Q4_0", "attn_q.weight": "Q8_0"})


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], gw.QuantTensor):
            assert (a[k].qtype, a[k].shape) == (b[k].qtype, b[k].shape) and np.array_equal(a[k].data, b[k].data)
        else:
            assert np.array_equal(a[k], b[k]), k


def test_summary_is_written_once_and_read_back(cache, quantized_llama):
    first = g.gguf_summary(quantized_llama)
    assert first is not None and len(list(cache.glob("*.json"))) == 1
    g._summary.cache_clear()
    assert g.gguf_summary(quantized_llama) == first  # from the file this time
    reader = gguf.GGUFReader(str(quantized_llama))
    assert g.gguf_config(quantized_llama) == g.gguf_config(reader)
    for keep in (frozenset(), frozenset({"Q4_0", "Q8_0"})):
        c1, w1 = gw.load_gguf_weights(quantized_llama, progress=False, keep_quantized=keep)
        c2, w2 = gw.load_gguf_weights(reader, progress=False, keep_quantized=keep)
        assert c1 == c2
        _same_weights(w1, w2)


def test_tokenizer_from_the_summary_encodes_as_the_readers(cache):
    path = g.find_default_gguf()
    a, b = g.load_gguf_tokenizer(path), g.load_gguf_tokenizer(gguf.GGUFReader(str(path)))
    text = "<|im_start|>user\nWhat is 12345 + 😀 in Zürich?<|im_end|>\n<|im_start|>assistant\n"
    assert a.tokenizer.encode(text).ids == b.tokenizer.encode(text).ids
    assert (a.eos_token_id, a.bos_token_id, a.chat_template, a.add_bos_token) == \
        (b.eos_token_id, b.bos_token_id, b.chat_template, b.add_bos_token)


def test_a_refused_file_is_not_summarized(cache, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    path = write_gguf(ckpt, tmp_path / "bad.gguf", "llama", "gpt2", general_architecture="gpt2")
    assert g.gguf_summary(path) is None
    with pytest.raises(NotImplementedError, match="gpt2"):
        g.gguf_config(path)


def test_the_cache_keeps_the_newest_summaries(cache, quantized_llama, monkeypatch, tmp_path):
    import shutil

    monkeypatch.setattr(g, "SUMMARIES_KEPT", 2)
    for i in range(3):
        copy = tmp_path / f"copy{i}.gguf"
        shutil.copy(quantized_llama, copy)
        assert g.gguf_summary(copy) is not None
    assert len(list(cache.glob("*.json"))) == 2


def test_eos_ids_come_from_the_summary_without_building_the_tokenizer(cache, quantized_llama):
    from shared.model_source import ModelSource

    src = ModelSource(str(quantized_llama))
    assert src.eos_token_ids == ModelSource(str(quantized_llama)).tokenizer.eos_token_ids
    assert "tokenizer" not in src.__dict__  # the gpu worker never builds it
