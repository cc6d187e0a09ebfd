"""Building the CPU kernels: cached by source, flags, compiler and CPU, and a failed build falls back to
torch's path (None) instead of failing the worker."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from services.gpu_worker import cpu_kernels

# Not marked `kernels`: these test the build's cache, keys, fallbacks and class choice, which
# are the same code whatever class is built; scripts/test's second run under
# MSTAR_CPU_CLASS=avx2 builds and runs the AVX2 object through every kernel test, and
# test_each_class_builds_its_own_object builds both classes here.


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("MSTAR_KERNEL_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    yield tmp_path
    cpu_kernels.library.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_builds_once_then_loads_from_the_cache(fresh, monkeypatch):
    # A real compile and link into an empty cache, then the same call again: the cached object,
    # no compiler run. Of one small kernel source and the headers it includes: the whole set
    # is compiled (and loaded with every symbol declared) by the suite's first kernel use
    # whenever a source, the flags or the CPU change, and compiling it all a second time here
    # cost ~25 s of every CI run (qgemm.c alone takes most of that).
    sources = fresh / "src"
    sources.mkdir()
    for name in ("elementwise.c", "silu_mul.h", "exp_poly.h"):
        shutil.copy(cpu_kernels.SOURCE_DIR / name, sources / name)
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", sources)
    built = cpu_kernels.build()
    assert built is not None and built.parent == fresh
    assert list(fresh.glob("mstar_kernels-*.so")) == [built]
    assert ctypes.CDLL(str(built)).mstar_rms_norm is not None  # a loadable object with the kernel in it
    calls = []
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(cpu_kernels.subprocess, "Popen", lambda *a, **k: calls.append(a))
    assert cpu_kernels.build() == built
    assert calls == []  # loaded from the cache, not compiled again
    assert list(fresh.glob("mstar_kernels-*.so")) == [built]


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
    # that shares the cache. What is under test is the cache key, not the compiler (a real
    # build into a fresh cache is test_builds_once_then_loads_from_the_cache's): each build
    # writes a stand-in object where the compiler and linker would have
    monkeypatch.setattr(cpu_kernels, "_compile", lambda cc, flags, sources, objects, out: Path(out).write_bytes(b"so"))
    first = cpu_kernels.build()
    monkeypatch.setattr(cpu_kernels, "cpu_signature", lambda: "x86_64 some other cpu without avx-512")
    second = cpu_kernels.build()
    assert first is not None and second is not None and first != second
    assert sorted(fresh.glob("mstar_kernels-*.so")) == sorted([first, second])


@pytest.fixture
def cpu_class_env(monkeypatch):
    """MSTAR_CPU_CLASS set by the test, the class cache cleared before and after."""
    cpu_kernels.cpu_class.cache_clear()
    yield monkeypatch
    cpu_kernels.cpu_class.cache_clear()


def test_the_host_class_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    zen4 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni"}
    for flags, want in ((zen4, "avx512"), (zen4 - {"avx512_vnni"}, "avx2"), ({"avx2", "fma", "f16c"}, "avx2"),
                        ({"avx", "sse4_2"}, "generic")):
        monkeypatch.setattr(cpu_kernels, "host_flags", lambda f=flags: f)
        assert cpu_kernels.host_class() == want, flags
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert cpu_kernels.host_class() == "neon"


def test_a_lower_x86_class_may_be_forced_never_a_higher_one(cpu_class_env):
    cpu_class_env.setattr(cpu_kernels, "host_class", lambda: "avx512")
    cpu_class_env.setenv("MSTAR_CPU_CLASS", "avx2")
    assert cpu_kernels.cpu_class() == "avx2"
    assert cpu_kernels.describe().startswith("kernels: avx2 (host avx512, MSTAR_CPU_CLASS")
    assert "-march=x86-64-v3" in cpu_kernels._flags() and "-march=native" not in cpu_kernels._flags()
    cpu_kernels.cpu_class.cache_clear()
    cpu_class_env.setattr(cpu_kernels, "host_class", lambda: "avx2")
    cpu_class_env.setenv("MSTAR_CPU_CLASS", "avx512")
    with pytest.raises(ValueError, match="MSTAR_CPU_CLASS=avx512: this CPU runs avx2, generic"):
        cpu_kernels.cpu_class()


def test_each_class_builds_its_own_object(cpu_class_env):
    if cpu_kernels.host_class() != "avx512":
        pytest.skip("needs an AVX-512 host to build both x86 classes")
    cpu_class_env.delenv("MSTAR_CPU_CLASS", raising=False)  # the host's class, whatever the env asks
    native = cpu_kernels.build()  # the suite's own cache: usually built already
    cpu_kernels.cpu_class.cache_clear()
    cpu_class_env.setenv("MSTAR_CPU_CLASS", "avx2")
    forced = cpu_kernels.build()
    assert native is not None and forced is not None and native != forced  # the class is in the object's key
    assert native.exists() and forced.exists()
