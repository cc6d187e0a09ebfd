"""KV pool memory on the CPU: zeros that cost resident memory only once written."""

from __future__ import annotations

from pathlib import Path

import torch

from services.gpu_worker.kv_memory import kv_cache, zeroed_tensor


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


def test_pool_is_zero_and_resident_only_where_written():
    before = _rss_mib()
    t = zeroed_tensor((512, 2, 16, 8, 64), torch.float32, torch.device("cpu"))  # 512 MiB
    assert _rss_mib() - before < 16, "the pool was made resident at allocation"
    t[3].fill_(1.0)  # one 64 KiB page written
    assert t[3].sum().item() == 2 * 16 * 8 * 64 and t[4].abs().sum().item() == 0
    assert t[100:110].abs().sum().item() == 0  # reads of unwritten pages are zeros
    assert _rss_mib() - before < 16
    del t


def test_prefault_makes_it_resident_at_start(monkeypatch):
    monkeypatch.setenv("MSTAR_KV_PREFAULT", "1")
    before = _rss_mib()
    t = zeroed_tensor((64, 1024, 1024), torch.uint8, torch.device("cpu"))  # 64 MiB
    assert _rss_mib() - before > 56
    assert t.max().item() == 0


def test_kv_cache_shape_one_tensor_per_layer():
    caches = kv_cache(3, 10, 16, 2, 8, torch.float32, torch.device("cpu"))
    assert len(caches) == 3 and all(c.shape == (10, 2, 16, 2, 8) and c.dtype == torch.float32 for c in caches)
    caches[0][1, 0] = 5.0
    assert caches[1].abs().sum().item() == 0  # separate memory per layer
