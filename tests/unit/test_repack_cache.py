"""The cache of repacked GGUF weights (services/gpu_worker/layers/repack_cache.py): a miss
repacks and keeps a file, a hit maps it and gives `quant.repack`'s arrays bit for bit, a
changed GGUF file or a partial / corrupt cache file is repacked again (never used), and
MSTAR_REPACK_CACHE=off keeps nothing."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from services.gpu_worker.gguf_weights import QuantTensor, load_gguf_weights
from services.gpu_worker.layers import quant, repack_cache
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf

#: both forms, with and without an offset (m)
QTYPES = {"token_embd.weight": "Q8_0", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q5_1",
          "attn_output.weight": "Q5_0", "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q8_0"}


@pytest.fixture(scope="module")
def model_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("repack")
    return write_gguf(make_checkpoint(root / "ckpt", "llama"), root / "model.gguf", "llama", "gpt2", qtypes=QTYPES)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_REPACK_CACHE", str(tmp_path / "rpk"))
    monkeypatch.delenv("MSTAR_REPACK_CACHE_BYTES", raising=False)
    return tmp_path / "rpk"


@pytest.fixture
def builds(monkeypatch):
    """How many times the tensors were repacked (cache misses)."""
    calls = []
    real = repack_cache.build

    def counted(state):
        calls.append(len(state))
        return real(state)

    monkeypatch.setattr(repack_cache, "build", counted)
    return calls


def quant_state(path) -> dict[str, QuantTensor]:
    _, arrays = load_gguf_weights(path, progress=False, keep_quantized=quant.KEPT_TYPES)
    state = {k: v for k, v in arrays.items() if isinstance(v, QuantTensor)}
    assert len(state) > 5
    return state


def assert_is_repack(entries, state) -> None:
    """Every entry is `quant.repack`'s result, bit for bit, and its layer `from_gguf`'s."""
    assert entries.keys() == state.keys()
    for name, qt in state.items():
        form, w, d, m = quant.repack(qt.qtype, qt.data, qt.shape)
        got = entries[name]
        assert got[0] == form and np.array_equal(got[1], w) and got[1].dtype == w.dtype, name
        assert np.array_equal(got[2], d) and got[2].dtype == d.dtype, name  # (float16 where the form says)
        assert (got[3] is None) == (m is None) and (m is None or np.array_equal(got[3], m)), name
    name, qt = next(iter(state.items()))
    layer = repack_cache.layer(entries[name], qt.shape)
    ref = quant.QuantLinear.from_gguf(qt.qtype, qt.data, qt.shape)
    assert (layer.form, layer.in_features, layer.out_features) == (ref.form, ref.in_features, ref.out_features)
    assert torch.equal(layer.weight, ref.weight)


def files(cache):
    return sorted(cache.glob(f"*{repack_cache.SUFFIX}"))


def test_miss_writes_the_file_and_a_hit_maps_the_same_arrays(cache, builds, model_gguf):
    state = quant_state(model_gguf)
    first = repack_cache.repacked(model_gguf, state)
    assert builds == [len(state)] and len(files(cache)) == 1
    assert_is_repack(first, state)
    second = repack_cache.repacked(model_gguf, state)
    assert builds == [len(state)]  # read, not repacked
    assert_is_repack(second, state)
    w = next(e for e in second.values() if e is not None)[1]
    assert isinstance(w.base, np.memmap) or isinstance(w, np.memmap)  # mapped from the file
    assert w.flags.writeable  # copy-on-write: torch takes it without a warning
    assert w.ctypes.data % repack_cache.ALIGN == 0


def test_a_changed_gguf_file_is_repacked(cache, builds, model_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model_gguf.read_bytes())
    state = quant_state(copy)
    repack_cache.repacked(copy, state)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file was replaced: a new key
    entries = repack_cache.repacked(copy, quant_state(copy))
    assert len(builds) == 2 and len(files(cache)) == 2
    assert_is_repack(entries, state)


def test_a_file_made_for_another_key_is_not_used(cache, builds, model_gguf):
    state = quant_state(model_gguf)
    repack_cache.repacked(model_gguf, state)
    (only,) = files(cache)
    other = {k: v for k, v in list(state.items())[:-1]}  # another set of tensors: another key
    os.replace(only, cache / f"{repack_cache.cache_key(model_gguf, other)}{repack_cache.SUFFIX}")
    assert repack_cache.read(files(cache)[0], repack_cache.cache_key(model_gguf, other)) is None
    assert_is_repack(repack_cache.repacked(model_gguf, other), other)
    assert len(builds) == 2


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate", "garbage header", "empty", "extra bytes"])
def test_a_corrupt_or_partial_file_is_rebuilt_not_used(cache, builds, model_gguf, damage):
    state = quant_state(model_gguf)
    repack_cache.repacked(model_gguf, state)
    (path,) = files(cache)
    raw = bytearray(path.read_bytes())
    if damage == "flip a data byte":
        raw[-100] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage header":
        raw[20:40] = b"x" * 20
    elif damage == "empty":
        raw = bytearray()
    else:
        raw += b"\0" * 64
    path.write_bytes(bytes(raw))
    assert repack_cache.read(path, repack_cache.cache_key(model_gguf, state)) is None
    entries = repack_cache.repacked(model_gguf, state)
    assert len(builds) == 2  # repacked again
    assert_is_repack(entries, state)
    assert repack_cache.read(path, repack_cache.cache_key(model_gguf, state)) is not None  # and rewritten whole


def test_off_by_env_keeps_nothing(tmp_path, monkeypatch, builds, model_gguf):
    monkeypatch.chdir(tmp_path)
    for off in ("off", "0"):
        monkeypatch.setenv("MSTAR_REPACK_CACHE", off)
        assert repack_cache.cache_dir() is None
        state = quant_state(model_gguf)
        assert_is_repack(repack_cache.repacked(model_gguf, state), state)
    assert len(builds) == 2 and not list(tmp_path.rglob(f"*{repack_cache.SUFFIX}"))


def test_the_byte_cap_keeps_the_newest_and_refuses_a_model_too_big(cache, builds, model_gguf, monkeypatch, tmp_path):
    state = quant_state(model_gguf)
    repack_cache.repacked(model_gguf, state)
    size = files(cache)[0].stat().st_size
    monkeypatch.setenv("MSTAR_REPACK_CACHE_BYTES", str(size + size // 2))  # room for one
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model_gguf.read_bytes())
    repack_cache.repacked(copy, quant_state(copy))
    (kept,) = files(cache)
    assert kept.name.startswith(repack_cache.cache_key(copy, quant_state(copy)))  # the older one went
    monkeypatch.setenv("MSTAR_REPACK_CACHE_BYTES", str(size // 2))
    os.utime(copy, ns=(0, 10**9))
    assert_is_repack(repack_cache.repacked(copy, quant_state(copy)), state)
    assert len(files(cache)) == 1  # too big for the cap: not written


def test_workers_starting_together_repack_once(cache, monkeypatch, model_gguf):
    state = quant_state(model_gguf)
    calls = []
    real = repack_cache.build

    def slow(s):
        calls.append(1)
        time.sleep(0.3)  # the other worker arrives while this one holds the lock
        return real(s)

    monkeypatch.setattr(repack_cache, "build", slow)
    results = []
    threads = [threading.Thread(target=lambda: results.append(repack_cache.repacked(model_gguf, state)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2
    for r in results:
        assert_is_repack(r, state)


def test_a_model_built_from_the_cache_computes_as_one_repacked(cache, model_gguf):
    from services.gpu_worker.weights import build_model
    from shared.model_source import ModelSource

    if not quant.available():
        pytest.skip("no quantized GEMM kernel")
    src = ModelSource(str(model_gguf))
    spec = src.spec(16)
    first = build_model(src, spec, torch.float32, quantized=True)  # a miss
    second = build_model(src, spec, torch.float32, quantized=True)  # a hit
    pairs = [(a, b) for a, b in zip(first.modules(), second.modules(), strict=True) if isinstance(a, quant.QuantLinear)]
    assert pairs
    for a, b in pairs:
        x = torch.linspace(-1, 1, 3 * a.in_features).reshape(3, a.in_features)
        assert torch.equal(a.weight, b.weight) and torch.equal(a(x), b(x))


def _mapped_rss_kib(path) -> int:
    """This process's resident KiB of the mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_released_tensors_leave_the_resident_set_and_read_back_the_same(cache, model_gguf):
    state = quant_state(model_gguf)
    repack_cache.repacked(model_gguf, state)  # written
    entries = repack_cache.repacked(model_gguf, state)  # mapped (and read whole by the checksum)
    (path,) = files(cache)
    arrays = [torch.from_numpy(a) for e in entries.values() if e is not None for a in e[1:] if a is not None]
    copies = [a.clone() for a in arrays]
    before = _mapped_rss_kib(path)
    assert before > 0
    released = repack_cache.release(arrays)
    assert released > 0 and _mapped_rss_kib(path) <= before - released // 1024 + 4
    assert all(torch.equal(a, c) for a, c in zip(arrays, copies))  # read back from the file
    heap = torch.arange(100_000, dtype=torch.float32)
    assert repack_cache.release([heap]) == 0 and torch.equal(heap, torch.arange(100_000, dtype=torch.float32))
