"""Building the CPU kernels: cached by source, flags, compiler and CPU, and a failed build falls back to
torch's path (None) instead of failing the worker."""

from __future__ import annotations

import shutil

import pytest

from services.gpu_worker import cpu_kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("MSTAR_KERNEL_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    yield tmp_path
    cpu_kernels.library.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_builds_once_then_loads_from_the_cache(fresh, monkeypatch):
    assert cpu_kernels.library() is not None
    built = list(fresh.glob("mstar_kernels-*.so"))
    assert len(built) == 1
    calls = []
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda *a, **k: calls.append(a))
    cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() is not None
    assert calls == []  # loaded from the cache, not compiled again
    assert list(fresh.glob("mstar_kernels-*.so")) == built


def test_a_failed_build_means_the_torch_path(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level("WARNING", logger="mstar.cpu_kernels"):
        assert cpu_kernels.library() is None
    assert "building the CPU kernels failed" in caplog.text
    assert not list(fresh.glob("*.so"))  # no partial object left behind


def test_switched_off_by_env(fresh, monkeypatch):
    monkeypatch.setenv("MSTAR_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    assert not list(fresh.glob("*.so"))


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_another_cpu_gets_its_own_build(fresh, monkeypatch):
    # -march=native: an object built for one CPU's instructions must never load on another
    # that shares the cache
    first = cpu_kernels.build()
    monkeypatch.setattr(cpu_kernels, "cpu_signature", lambda: "x86_64 some other cpu without avx-512")
    second = cpu_kernels.build()
    assert first is not None and second is not None and first != second
    assert sorted(fresh.glob("mstar_kernels-*.so")) == sorted([first, second])
