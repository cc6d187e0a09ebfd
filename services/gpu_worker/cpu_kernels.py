"""C kernels for the CPU path (paged attention, GEMM, fused elementwise ops), built at first use
with the machine's C compiler.

Why not a torch C++ extension: one that includes torch's headers takes most of a minute to
compile, which would cost the worker's start-up; these are plain C over raw pointers and
build in well under a second, for this very CPU (`-march=native`). The shared object is
cached by a hash of its source, flags and compiler, so a restart only loads it.

Where there is no compiler (a slim image), or `MSTAR_CPU_KERNELS=0`, or the build fails,
`library()` returns None and attention keeps its torch path: same results, slower
decode. Nothing else depends on a kernel being there.

The kernels are built for one class of CPU (`cpu_class()`): `avx512` (AVX-512 with VNNI,
BW and VL: Zen 4+, Ice Lake+, Sapphire Rapids; hosts with AMX run it too), `avx2` (AVX2,
FMA and F16C, x86-64-v3: Zen 2/3, Haswell+ and every recent desktop chip), `neon` (64-bit
Arm) or `generic` (anything else: plain C the compiler vectorizes as it can). Each kernel
picks its code for the class at compile time. `MSTAR_CPU_CLASS` forces a lower x86 class
than the host's (`avx2` on an AVX-512 host), so every x86 path is built, tested and
measured on any x86 machine; a class the host cannot run is refused. The class is part of
the build's flags, so of the cached shared object's name and of every cache keyed by it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("mstar.cpu_kernels")

SOURCE_DIR = Path(__file__).resolve().parent / "kernels"


#: x86 kernel classes, best first, and the CPU flags each needs
X86_CLASSES = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), "avx2": ("avx2", "fma", "f16c"),
               "generic": ()}
#: compiler flags per class (avx2: exactly x86-64-v3, so a forced AVX2 build on an AVX-512
#: host runs the instructions an AVX2-only machine has, no more)
CLASS_FLAGS = {"avx512": ["-march=native", "-mprefer-vector-width=512"], "avx2": ["-march=x86-64-v3", "-mtune=native"],
               "generic": ["-march=x86-64-v2", "-mtune=native"], "neon": ["-mcpu=native"]}


def host_flags() -> set[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`) from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return set()


def host_class() -> str:
    """The best kernel class this CPU runs."""
    if platform.machine() in ("aarch64", "arm64"):
        return "neon"
    if platform.machine() not in ("x86_64", "AMD64"):
        return "generic"
    flags = host_flags()
    return next(c for c, need in X86_CLASSES.items() if all(f in flags for f in need))


@functools.cache
def cpu_class() -> str:
    """The class the kernels are built for: the host's, or a lower x86 one that
    `MSTAR_CPU_CLASS` asks for (ValueError for a class the host cannot run)."""
    host = host_class()
    asked = os.environ.get("MSTAR_CPU_CLASS", "auto").strip().lower() or "auto"
    if asked == "auto" or asked == host:
        return host
    order = list(X86_CLASSES)
    if host in order and asked in order and order.index(asked) > order.index(host):
        return asked
    runs = ", ".join(order[order.index(host):]) if host in order else host
    raise ValueError(f"MSTAR_CPU_CLASS={asked}: this CPU runs {runs} (auto: {host})")


def describe() -> str:
    """`kernels: <class>` for the start-up log, with the host's class where it was forced
    lower and `amx` where the host has AMX (which no kernel uses yet)."""
    cls, host = cpu_class(), host_class()
    extra = [f"host {host}, MSTAR_CPU_CLASS"] if cls != host else []
    if "amx_int8" in host_flags():
        extra.append("host has amx")
    return f"kernels: {cls}" + (f" ({'; '.join(extra)})" if extra else "")


def class_flags(cls: str) -> list[str]:
    """The compiler flags a build for class `cls` uses (tests/unit/test_kernels_aarch64.py
    cross-compiles the `neon` build with them, `-march=armv8-a` for `-mcpu=native`)."""
    # -fno-trapping-math: no kernel reads the FP exception flags, and without it GCC 12 will
    # not if-convert exp_poly's two clamps at AVX2 (x86-64-v3), leaving SiLU, GELU and the
    # softmax scalar there; the values are IEEE's either way (unlike -ffast-math)
    return ["-O3", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC", *CLASS_FLAGS[cls]]


def _flags() -> list[str]:
    return class_flags(cpu_class())


def cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags (from
    /proc/cpuinfo where there is one). Part of the cache key, so a cache shared between
    different machines (a mounted home, a copied image) never hands one CPU a shared
    object built for another's instructions."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    seen: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in keep:
            seen.setdefault(key.strip(), value.strip())
    return f"{platform.machine()} {sorted(seen.items())}"


def cache_dir() -> Path:
    """`MSTAR_KERNEL_CACHE`, else ~/.cache/mstar/kernels (a temp dir if home is read-only)."""
    env = os.environ.get("MSTAR_KERNEL_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "mstar" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return Path(tempfile.gettempdir())


def build(name: str = "mstar_kernels") -> Path | None:
    """Compile every kernels/*.c into one shared object in the cache (if not there yet);
    its path, or None."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: the CPU path uses torch's ops")
        return None
    sources = sorted(SOURCE_DIR.glob("*.c"))
    flags = _flags()
    digest = hashlib.sha256(" ".join([cc, *flags, cpu_signature()]).encode())
    for src in sorted(SOURCE_DIR.glob("*.[ch]")):  # the headers they include, too
        digest.update(src.name.encode() + src.read_bytes())
    out = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objects:
            _compile(cc, flags, sources, Path(objects), tmp)
        os.replace(tmp, out)  # atomic: a concurrent worker sees the whole file or none
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (exc.stderr.decode(errors="replace")[-500:] if isinstance(exc, subprocess.CalledProcessError)
                  else str(exc))
        log.warning("building the CPU kernels failed (torch's ops are used): %s", detail)
        Path(tmp).unlink(missing_ok=True)
        return None
    return out


#: seconds one source may take to compile (qgemm.c takes ~35 s on a quiet Zen core, and
#: more than twice that on a loaded one: a build that gives up costs the torch path)
COMPILE_TIMEOUT_S = 600


def _compile(cc: str, flags: list[str], sources: list[Path], objects: Path, out: str) -> None:
    """Every source to an object at once (the cores build them side by side: the build
    takes the longest source's time, not the sum), then one link; CalledProcessError with
    the compiler's output for the first that fails."""
    compile_flags = [f for f in flags if f != "-shared"]
    jobs = [(src, objects / f"{src.stem}.o") for src in sources]
    procs = [(src, subprocess.Popen([cc, *compile_flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)) for src, obj in jobs]
    failed: subprocess.CalledProcessError | None = None
    for src, proc in procs:
        try:
            output, _ = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        if proc.returncode and failed is None:
            failed = subprocess.CalledProcessError(proc.returncode, f"{cc} -c {src.name}", output, output)
    if failed is not None:
        raise failed
    subprocess.run([cc, *flags, "-o", out, *(str(obj) for _, obj in jobs), "-lm"], check=True,
                   capture_output=True, timeout=COMPILE_TIMEOUT_S)


@functools.cache
def library() -> ctypes.CDLL | None:
    """kernels/*.c, built and loaded (None: use torch's ops)."""
    if os.environ.get("MSTAR_CPU_KERNELS", "1").lower() in ("0", "false", "no"):
        return None
    try:
        log.info("%s", describe())
    except ValueError as exc:
        log.error("%s; the CPU kernels are off (torch's ops are used)", exc)
        return None
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as exc:
        log.warning("loading the CPU kernels failed (torch's ops are used): %s", exc)
        return None
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """Every kernel's C signature, so ctypes passes 64-bit ints and pointers as the C code
    takes them (AttributeError for a symbol the library lacks: a stale or partial build)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mstar_paged_decode.restype = ctypes.c_int
    lib.mstar_paged_decode.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                       ctypes.c_float, ptr, ptr, i64]
    lib.mstar_write_kv.restype = None
    lib.mstar_write_kv.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64]
    lib.mstar_rms_norm.restype = lib.mstar_rope.restype = lib.mstar_silu_mul.restype = None
    lib.mstar_rms_norm.argtypes = [ptr, i64, ptr, ctypes.c_float, ptr, i64, i64]
    lib.mstar_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64]
    lib.mstar_silu_mul.argtypes = [ptr, i64, i64, ptr, i64]
    lib.mstar_gelu_mul.restype = lib.mstar_head_norm.restype = None
    lib.mstar_gelu_mul.argtypes = [ptr, i64, i64, ptr, i64]
    lib.mstar_head_norm.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_float]
    lib.mstar_gemm_nr.restype = i64
    lib.mstar_gemm_nr.argtypes = []
    lib.mstar_gemm_pack.restype = lib.mstar_gemm_unpack.restype = None
    lib.mstar_gemm_pack.argtypes = lib.mstar_gemm_unpack.argtypes = [ptr, i64, i64, ptr]
    lib.mstar_moe_route.restype = ctypes.c_int
    lib.mstar_moe_route.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr]
    lib.mstar_gemm.restype = ctypes.c_int
    lib.mstar_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64]
    lib.mstar_gemm_silu.restype = ctypes.c_int
    lib.mstar_gemm_silu.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64]
    lib.mstar_qgemm_available.restype = i64
    lib.mstar_qgemm_available.argtypes = []
    lib.mstar_qlinear_scratch.restype = i64
    lib.mstar_qlinear_scratch.argtypes = [i64, i64]
    lib.mstar_qrows.restype = ctypes.c_int
    lib.mstar_qrows.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64]
    lib.mstar_qgemm_set_head_prefetch.restype = None
    lib.mstar_qgemm_set_head_prefetch.argtypes = [ctypes.c_int]
    lib.mstar_qlinear.restype = ctypes.c_int
    lib.mstar_qlinear.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64,
                                  ctypes.c_int, ptr]
    lib.mstar_causal_conv.restype = lib.mstar_gated_delta.restype = ctypes.c_int
    lib.mstar_causal_conv.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.mstar_gated_delta.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, ptr,
                                      i64, ptr, i64, ptr]
    lib.mstar_gated_rms_norm.restype = None
    lib.mstar_gated_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_float, ptr, i64, i64]
    lib.mstar_rope_partial.restype = lib.mstar_sigmoid_gate.restype = lib.mstar_gdn_gates.restype = None
    lib.mstar_rope_partial.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64]
    lib.mstar_sigmoid_gate.argtypes = [ptr, i64, i64, i64, ptr, i64, i64]
    lib.mstar_gdn_gates.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.mstar_sigmoid.restype = None
    lib.mstar_sigmoid.argtypes = [ptr, i64, ptr]
    lib.mstar_pool_threads.restype = ctypes.c_int
    lib.mstar_pool_threads.argtypes = []
    lib.mstar_pool_set_threads.restype = lib.mstar_pool_stats.restype = None
    lib.mstar_pool_set_threads.argtypes = [ctypes.c_int]
    lib.mstar_pool_stats.argtypes = [ptr]
    lib.mstar_pool_check.restype = i64
    lib.mstar_pool_check.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]


def gemm_panel() -> int:
    """Output columns per packed panel of `mstar_gemm` (0: no GEMM kernel, e.g. no AVX-512)."""
    lib = library()
    return 0 if lib is None else int(lib.mstar_gemm_nr())


def paged_decode():
    """`mstar_paged_decode` (decode rows over their pages in place), or None."""
    lib = library()
    return None if lib is None else lib.mstar_paged_decode


def write_kv():
    """`mstar_write_kv` (a step's K/V rows into their pages), or None."""
    lib = library()
    return None if lib is None else lib.mstar_write_kv
