"""The CPU kernels built for 64-bit Arm and run there, checked against torch's ops.

Why: the kernels are built at first use for the host's class (cpu_kernels.py), and every
machine the tests run on is x86, so the `neon` build (and every kernel's plain-C path, which
is all that class has beside pool.c's aarch64 branch) would otherwise never be compiled. Here
kernels/*.c are cross-compiled for aarch64 with the `neon` class's flags (`-march=armv8-a` for
`-mcpu=native`) into one shared object, tests/kernels_driver/driver.c is linked against it, and
the driver runs under qemu-user on small inputs made here; its outputs are compared with the
same references and tolerances as the x86 tests (test_fused.py, test_attention.py,
test_prefill_attention.py, test_quant.py ...). What the class does not offer (the float GEMM,
prefill attention and the quantized GEMM are x86-only today) must refuse as the Python callers
expect, so they keep torch's path; NEON_HAS says what it offers, and a change either way fails
here until it is updated (and the kernel, once offered, is compared too).

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user;
.ci/run installs them). Without them it skips on a developer machine; under CI=true it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker import attention, cpu_kernels
from services.gpu_worker.layers import quant
from services.gpu_worker.layers.quant import QuantLinear
from services.gpu_worker.modeling.decoder.lm import Rotary, _apply_rope
from shared.model_config import RopeConfig
from tests.unit.test_quant import random_blocks

CC = "aarch64-linux-gnu-gcc"
NM = "aarch64-linux-gnu-nm"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # the cross toolchain's libc, libm, libgomp: qemu's -L
DRIVER = Path(__file__).resolve().parents[1] / "kernels_driver" / "driver.c"
#: what the neon build offers beside the portable kernels (each refuses with -1 / 0 without it)
NEON_HAS = {"gemm": False, "prefill": False, "qgemm": False}

#: one call for the driver: entry point (without mstar_), buffers (None: NULL), ints, floats
CallSpec = tuple[str, Sequence[torch.Tensor | None], Sequence[int], Sequence[float]]


def neon_flags() -> list[str]:
    """The `neon` class's build flags for a generic ARMv8-A target: `-mcpu=native` means the
    build machine's CPU, which here is x86."""
    native = ("-mcpu=native", "-march=native", "-mtune=native")
    return [f for f in cpu_kernels.class_flags("neon") if f not in native] + ["-march=armv8-a"]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass
class Result:
    """One call's return value and its buffers after the call (as the tensors passed)."""

    rc: int
    out: list[torch.Tensor | None]


class Arm:
    """The cross-built kernels and driver; `run` executes calls under qemu."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.lib = where / "libmstar_kernels.so"
        self.driver = where / "driver"

    def build(self) -> None:
        """kernels/*.c with the neon flags into one shared object (each file compiled in its own
        process, at once: the -O3 build is most of this module's time), and the driver."""
        flags = neon_flags()
        objects, jobs = [], []
        for src in sorted(cpu_kernels.SOURCE_DIR.glob("*.c")):
            obj = self.where / f"{src.stem}.o"
            # what GCC 14 refuses anyway, refused here on GCC 12 too (a missing prototype)
            args = [*(f for f in flags if f != "-shared"), "-Werror=implicit-function-declaration", "-c", "-o",
                    str(obj), str(src)]
            jobs.append((args, subprocess.Popen([CC, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True)))
            objects.append(str(obj))
        for args, job in jobs:
            _, err = job.communicate(timeout=300)
            self._check(args, job.returncode, err)
        self._cc([*flags, "-o", str(self.lib), *objects, "-lm"])
        self._cc(["-O1", "-Wall", "-Werror", "-o", str(self.driver), str(DRIVER), f"-L{self.where}",
                  "-lmstar_kernels", "-Wl,-rpath,$ORIGIN"])

    @classmethod
    def _cc(cls, args: list[str]) -> None:
        done = subprocess.run([CC, *args], capture_output=True, text=True, timeout=300)
        cls._check(args, done.returncode, done.stderr)

    @staticmethod
    def _check(args: list[str], rc: int, stderr: str) -> None:
        if rc != 0:
            pytest.fail(f"the aarch64 build failed: {CC} {' '.join(args)}\n{stderr[-4000:]}")

    def run(self, calls: Sequence[CallSpec], name: str = "calls") -> list[Result]:
        """Each (entry point, buffers, ints, floats) in order, in one process under qemu; the
        buffers as driver.c takes them (None: NULL), every tensor contiguous."""
        blob = bytearray()
        for fn, bufs, ints, floats in calls:
            blob += struct.pack("<q", len(fn)) + fn.encode()
            blob += struct.pack("<q", len(bufs))
            for b in bufs:
                raw = b"" if b is None else _bytes(b)
                blob += struct.pack("<q", len(raw)) + raw
            blob += struct.pack(f"<q{len(ints)}q", len(ints), *ints)
            blob += struct.pack(f"<q{len(floats)}d", len(floats), *floats)
        src, dst = self.where / f"{name}.in", self.where / f"{name}.out"
        src.write_bytes(bytes(blob))
        done = subprocess.run([QEMU, "-L", str(SYSROOT), str(self.driver), str(src), str(dst)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"the driver failed under qemu ({done.returncode}): {done.stderr[-2000:]}"
        data, at, results = dst.read_bytes(), 0, []
        for _, bufs, _, _ in calls:
            rc, nb = struct.unpack_from("<qq", data, at)
            at += 16
            assert nb == len(bufs)
            outs: list[torch.Tensor | None] = []
            for b in bufs:
                (n,) = struct.unpack_from("<q", data, at)
                at += 8
                outs.append(None if b is None else torch.frombuffer(bytearray(data[at:at + n]), dtype=b.dtype)
                            .reshape(b.shape))
                at += n
            results.append(Result(rc, outs))
        assert at == len(data)
        return results

    def one(self, fn: str, bufs: Sequence[torch.Tensor | None], ints: Sequence[int] = (),
            floats: Sequence[float] = ()) -> Result:
        return self.run([(fn, bufs, ints, floats)], fn)[0]


def _bytes(t: torch.Tensor) -> bytes:
    assert t.is_contiguous(), "the driver takes whole contiguous buffers (strides go as ints)"
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> Arm:
    """The kernels and the driver built for aarch64 (once for the module)."""
    missing = [tool for tool in (CC, NM, QEMU) if shutil.which(tool) is None]
    if missing:
        why = (f"{', '.join(missing)} not found (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user): "
               "the aarch64 kernels are not checked")
        if in_ci():
            pytest.fail(f"CI=true: {why}")
        pytest.skip(why)
    built = Arm(tmp_path_factory.mktemp("aarch64"))
    built.build()
    return built


def test_the_build_is_aarch64_and_exports_every_entry_point(arm):
    """The shared object is an ELF for AArch64 (e_machine 183) and defines every mstar_ name the
    Python callers look up, so a kernel that lost its portable path would not load on Arm."""
    head = arm.lib.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and struct.unpack_from("<H", head, 18)[0] == 183
    names = subprocess.run([NM, "-D", "--defined-only", str(arm.lib)], capture_output=True, text=True,
                           check=True).stdout.split()
    gpu = Path(cpu_kernels.__file__).parent
    wanted = {"mstar_write_kv_bf16", "mstar_paged_decode_bf16", "mstar_write_kv_i8", "mstar_paged_decode_i8"}
    for py in gpu.rglob("*.py"):  # attributes of the loaded library: lib.mstar_...
        wanted |= set(re.findall(r"\.(mstar_\w+)\b", py.read_text()))
    assert wanted and wanted <= set(names), f"not exported for aarch64: {sorted(wanted - set(names))}"


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_rms_norm_and_head_norm(arm, rows):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 128) * 3, torch.randn(96)  # rows 128 floats apart, 96 normalised
    heads, d = 6, 16  # head_norm on heads [0, 4) of each row, in place
    hw = torch.randn(d)
    hx = torch.randn(rows, heads * d) * 3
    norm, head = arm.run([("rms_norm", [x, w, torch.empty(rows, 96)], [128, rows, 96], [1e-6]),
                          ("head_norm", [hx, hw], [heads * d, rows, 4, d], [1e-6])])
    xs = x[:, :96]
    ref = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(norm.out[2], ref, rtol=1e-5, atol=1e-6)
    got, before = head.out[0].view(rows, heads, d), hx.view(rows, heads, d)
    want = before[:, :4] * torch.rsqrt(before[:, :4].pow(2).mean(-1, keepdim=True) + 1e-6) * hw
    torch.testing.assert_close(got[:, :4], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, 4:], before[:, 4:])


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_in_place_on_strided_heads(arm, head_dim):
    torch.manual_seed(head_dim)
    heads, kv_heads, t = 4, 2, 5
    cos, sin_signed = Rotary(RopeConfig(), head_dim, 64).tables(torch.tensor([0, 3, 7, 8, 63]), torch.float32)
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim)
    row = (heads + 2 * kv_heads) * head_dim
    (res,) = arm.run([("rope", [qkv, cos.contiguous(), sin_signed.contiguous()],
                       [row, t, heads + kv_heads, head_dim, head_dim], [])])
    got = res.out[0]
    ref = _apply_rope(qkv[:, : heads + kv_heads].clone(), cos, sin_signed)
    torch.testing.assert_close(got[:, : heads + kv_heads], ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])  # v untouched


def test_silu_mul_and_gelu_mul(arm):
    torch.manual_seed(0)
    inter = 200
    gate_up = torch.randn(7, 2 * inter) * 6  # large |gate| too: exp's clamps
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -88.5, 1e-4, -1e-4])
    silu, gelu = arm.run([(fn, [gate_up, torch.empty(7, inter)], [2 * inter, inter, 7], [])
                          for fn in ("silu_mul", "gelu_mul")])
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    torch.testing.assert_close(silu.out[1], F.silu(g) * u, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gelu.out[1].double(), F.gelu(g.double(), approximate="tanh") * u.double(), rtol=1e-5,
                               atol=1e-9)


# -- paged attention -------------------------------------------------------------------------

PAGE = 16


@dataclass
class Pool:
    """Requests' K/V rows on pages scattered through a pool, and the decode rows' metadata
    (driver order: pages [B, width], qrow, entry, lo, hi)."""

    k: list[torch.Tensor]  # per request [n, hkv, d]
    v: list[torch.Tensor]
    pages: torch.Tensor
    slot_pages: torch.Tensor  # per written row (all requests' rows in order)
    slot_offsets: torch.Tensor
    meta: list[torch.Tensor]
    rows: list[tuple[int, int, int]]  # per query row: (request, lo, hi)


def make_pool(lengths: Sequence[int], queries: Sequence[int], hkv: int, d: int, window: int | None,
              seed: int) -> Pool:
    """Request r holds lengths[r] rows; its last queries[r] rows are query rows, each seeing
    its prefix (bottom-right causal: a multi-row entry's row i sees rows up to n - q + i),
    cut to the last `window` rows where there is one."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // PAGE) for n in lengths]
    perm = torch.randperm(sum(n_pages) + 5, generator=g).tolist()
    width = max(n_pages)
    pages = torch.zeros(len(lengths), width, dtype=torch.int64)
    ks, vs, sp, so, rows = [], [], [], [], []
    for r, (n, q) in enumerate(zip(lengths, queries)):
        mine = [perm.pop() for _ in range(n_pages[r])]
        pages[r, : len(mine)] = torch.tensor(mine)
        ks.append(torch.randn(n, hkv, d, generator=g) * 2)
        vs.append(torch.randn(n, hkv, d, generator=g))
        sp += [mine[i // PAGE] for i in range(n)]
        so += [i % PAGE for i in range(n)]
        for i in range(n - q, n):
            rows.append((r, 0 if window is None else max(0, i + 1 - window), i + 1))
    idx = torch.arange(len(rows))
    meta = [idx, torch.tensor([r for r, _, _ in rows]), torch.tensor([lo for _, lo, _ in rows]),
            torch.tensor([hi for _, _, hi in rows])]
    return Pool(ks, vs, pages, torch.tensor(sp), torch.tensor(so), meta, rows)


def decode_reference(q: torch.Tensor, pool: Pool, k: list[torch.Tensor], v: list[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Each query row's softmax attention over its keys [lo, hi) (SDPA, GQA)."""
    out = torch.empty_like(q)
    for i, (r, lo, hi) in enumerate(pool.rows):
        o = F.scaled_dot_product_attention(q[i].unsqueeze(1), k[r][lo:hi].transpose(0, 1),
                                           v[r][lo:hi].transpose(0, 1), scale=scale, enable_gqa=True)
        out[i] = o.squeeze(1)
    return out


def decode_call(kind: str, q: torch.Tensor, cache: torch.Tensor, pool: Pool, hq: int, hkv: int, d: int,
                scale: float) -> CallSpec:
    keys = pool.pages.shape[1] * PAGE
    n = q.shape[0]
    return (f"paged_decode{kind}", [q, cache, pool.pages, *pool.meta, torch.zeros(n, hq, d)],
            [hq * d, pool.pages.shape[1], n, hq, hkv, d, PAGE, keys], [scale])


def write_call(kind: str, cache: torch.Tensor, pool: Pool, hkv: int, d: int) -> CallSpec:
    k, v = torch.cat(pool.k).reshape(-1, hkv * d), torch.cat(pool.v).reshape(-1, hkv * d)
    ints = [hkv * d, hkv * d, k.shape[0], hkv * d] + ([d] if kind == "_i8" else []) + [PAGE]
    return (f"write_kv{kind}", [cache, k, v, pool.slot_pages, pool.slot_offsets], ints, [])


#: lengths across page (16) and partition (512 keys) boundaries; the last request's 5 rows are
#: a multi-row entry (a chunk's bottom-right causal mask)
LENGTHS, QUERIES = [1, 15, 16, 17, 40, 600], [1, 1, 1, 1, 1, 5]


@pytest.mark.parametrize("heads", [(8, 2, 64), (6, 6, 32), (16, 1, 128)])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_decode_float32_pages(arm, heads, window):
    """write_kv puts each row where the pool layout says; the decode over the pages equals
    SDPA over each row's prefix (GQA, sliding window), and the same bits on 1 and 4 threads."""
    hq, hkv, d = heads
    pool = make_pool(LENGTHS, QUERIES, hkv, d, window, seed=hq + d)
    cache = torch.zeros(int(pool.pages.max()) + 3, 2, PAGE, hkv, d)
    q = torch.randn(len(pool.rows), hq, d, generator=torch.Generator().manual_seed(1)) * 2
    scale = d**-0.5
    write = write_call("", cache, pool, hkv, d)
    written = arm.run([write])[0].out[0]
    want = torch.zeros_like(cache)
    want[pool.slot_pages, 0, pool.slot_offsets] = torch.cat(pool.k)
    want[pool.slot_pages, 1, pool.slot_offsets] = torch.cat(pool.v)
    assert torch.equal(written, want)
    one, _, four = arm.run([("pool_set_threads", [], [1], []), decode_call("", q, written, pool, hq, hkv, d, scale),
                            ("pool_set_threads", [], [4], []), decode_call("", q, written, pool, hq, hkv, d, scale)]
                           )[1:]
    assert one.rc == 0 and four.rc == 0
    torch.testing.assert_close(one.out[-1], decode_reference(q, pool, pool.k, pool.v, scale), rtol=1e-5, atol=1e-5)
    assert torch.equal(one.out[-1], four.out[-1])


def test_paged_decode_bfloat16_and_int8_pages(arm):
    """The bfloat16 and int8 writes store torch's conversion and attention.quantize_kv's bytes;
    each decode equals SDPA on the pages' values read back."""
    hq, hkv, d = 8, 2, 64
    pool = make_pool(LENGTHS, QUERIES, hkv, d, None, seed=3)
    n_pages = int(pool.pages.max()) + 3
    q = torch.randn(len(pool.rows), hq, d, generator=torch.Generator().manual_seed(2)) * 2
    bf16 = torch.zeros(n_pages, 2, PAGE, hkv, d, dtype=torch.bfloat16)
    i8 = torch.zeros(n_pages, 2, PAGE, hkv, d + attention.INT8_SCALE_BYTES, dtype=torch.int8)
    wb, wi = arm.run([write_call("_bf16", bf16, pool, hkv, d), write_call("_i8", i8, pool, hkv, d)])
    for cache, got, conv in ((bf16, wb.out[0], lambda x: x.to(torch.bfloat16)), (i8, wi.out[0], attention.quantize_kv)):
        want = torch.zeros_like(cache)
        want[pool.slot_pages, 0, pool.slot_offsets] = conv(torch.cat(pool.k))
        want[pool.slot_pages, 1, pool.slot_offsets] = conv(torch.cat(pool.v))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    db, di = arm.run([decode_call("_bf16", q, wb.out[0], pool, hq, hkv, d, d**-0.5),
                      decode_call("_i8", q, wi.out[0], pool, hq, hkv, d, d**-0.5)])
    for res, read in ((db, lambda x: x.to(torch.bfloat16).float()),
                      (di, lambda x: attention.dequantize_kv(attention.quantize_kv(x)))):
        assert res.rc == 0
        ref = decode_reference(q, pool, [read(k) for k in pool.k], [read(v) for v in pool.v], d**-0.5)
        torch.testing.assert_close(res.out[-1], ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_refuses_what_it_does_not_take(arm):
    """-1 for query heads not a multiple of KV heads, -2 for a row with more keys than max_keys:
    the codes attention.py raises on."""
    pool = make_pool([20], [1], 2, 16, None, seed=0)
    cache = torch.zeros(int(pool.pages.max()) + 1, 2, PAGE, 2, 16)
    odd = decode_call("", torch.randn(1, 3, 16), cache, pool, 3, 2, 16, 0.25)
    name, bufs, ints, floats = decode_call("", torch.randn(1, 4, 16), cache, pool, 4, 2, 16, 0.25)
    heads, keys = arm.run([odd, (name, bufs, [*ints[:-1], 10], floats)])  # 20 keys, max_keys 10
    assert heads.rc == -1 and keys.rc == -2


# -- what the class offers beyond the portable kernels ---------------------------------------


@pytest.mark.parametrize("window", [0, 20])
def test_prefill_attention_or_its_refusal(arm, window):
    """A 37-row chunk over 90 keys (bottom-right causal, GQA, scattered pages): equal to SDPA
    where the class has the kernel, else -1 and nothing written (attention.py keeps SDPA)."""
    hq, hkv, d, q_len, kv_len = 8, 2, 64, 37, 90
    pool = make_pool([kv_len], [0], hkv, d, None, seed=5)
    cache = torch.zeros(int(pool.pages.max()) + 2, 2, PAGE, hkv, d)
    cache[pool.slot_pages, 0, pool.slot_offsets] = pool.k[0]
    cache[pool.slot_pages, 1, pool.slot_offsets] = pool.v[0]
    q = torch.randn(q_len, hq, d, generator=torch.Generator().manual_seed(6))
    out = torch.full((q_len, hq, d), 7.0)
    res = arm.one("prefill_attention", [q, cache, pool.pages[0].contiguous(), out],
                  [hq * d, 0, q_len, kv_len, hq, hkv, d, PAGE, window, hq * d], [d**-0.5])
    assert (res.rc == 0) == NEON_HAS["prefill"], f"prefill_attention on aarch64 returned {res.rc}: update NEON_HAS"
    if res.rc != 0:
        assert res.rc == -1 and torch.equal(res.out[3], out)
        return
    mask = attention.window_mask(torch.arange(kv_len - q_len, kv_len), torch.arange(kv_len), window or None)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), pool.k[0].transpose(0, 1), pool.v[0].transpose(0, 1),
                                         attn_mask=mask, scale=d**-0.5, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(res.out[3], ref, rtol=1e-5, atol=1e-5)


def test_float_gemm_or_its_refusal(arm):
    """Where the class has the float GEMM (mstar_gemm_nr() > 0), the packed layout round-trips
    and the GEMM equals x @ w.T + b (in float64, as test_linear.py); where not, the panel width
    is 0 and mstar_gemm returns -1, so linear.py keeps torch's matmul and never packs."""
    torch.manual_seed(0)
    n, k, m = 100, 72, 5
    w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    nr = arm.one("gemm_nr", []).rc
    assert (nr > 0) == NEON_HAS["gemm"], f"mstar_gemm_nr() on aarch64 is {nr}: update NEON_HAS"
    if nr == 0:
        assert arm.one("gemm", [x, torch.zeros(1), b, torch.zeros(m, n)], [m, k, k, n, n]).rc == -1
        return
    packed = arm.one("gemm_pack", [w, torch.zeros(-(-n // nr), k, nr)], [n, k]).out[1]
    assert packed is not None
    assert torch.equal(arm.one("gemm_unpack", [packed, torch.zeros(n, k)], [n, k]).out[1], w)
    res = arm.one("gemm", [x, packed, b, torch.zeros(m, n)], [m, k, k, n, n])
    assert res.rc == 0 and res.out[3] is not None
    ref = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(res.out[3], ref, rtol=1e-5, atol=1e-5)


def test_quantized_rows_and_the_gemm_refusal(arm):
    """mstar_qrows (an embedding lookup; portable C, fp-contract off) reproduces
    gguf.quants.dequantize bit for bit for every kept type, and refuses an id past the table
    with -2; the quantized GEMM is not offered (mstar_qgemm_available() 0, mstar_qlinear -1:
    layers/quant.py dequantizes)."""
    types = sorted(quant.KEPT_TYPES)
    ids = torch.tensor([5, 39, 0, 16, 5])
    calls: list[CallSpec] = []
    wants = []
    for qtype in types:
        k = 768 if qtype.endswith("_K") or qtype == "IQ4_XS" else 96
        raw = random_blocks(qtype, 40, k)
        layer = QuantLinear.from_gguf(qtype, raw, (40, k))
        weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(40, k).copy())
        bufs = [layer.w.contiguous(), layer.d.contiguous(), None if layer.m is None else layer.m.contiguous()]
        calls.append(("qrows", [*bufs, ids, torch.zeros(len(ids), k)], [layer.form, 40, k, len(ids), k], []))
        calls.append(("qrows", [*bufs, torch.tensor([40]), torch.zeros(1, k)], [layer.form, 40, k, 1, k], []))
        wants.append(weight[ids])
    calls.append(("qgemm_available", [], [], []))
    q4 = QuantLinear.from_gguf("Q4_0", random_blocks("Q4_0", 32, 64), (32, 64))
    calls.append(("qlinear", [torch.randn(2, 64), q4.w, q4.d, q4.m, None, torch.zeros(2, 32)],
                  [q4.form, 2, 2, 64, 64, 32, 32, 1], []))
    results = arm.run(calls)
    for i, (qtype, want) in enumerate(zip(types, wants)):
        rows, past = results[2 * i], results[2 * i + 1]
        assert rows.rc == 0 and torch.equal(rows.out[4], want), qtype
        assert past.rc == -2, qtype
    available, qlinear = results[-2:]
    assert bool(available.rc) == NEON_HAS["qgemm"], f"mstar_qgemm_available() on aarch64 is {available.rc}"
    assert qlinear.rc == (0 if NEON_HAS["qgemm"] else -1)


def test_thread_pool_runs_each_task_once(arm):
    """pool.c's aarch64 branch (yield in the spin, futexes, atomics) under 4 threads: each task
    of each job exactly once (mstar_pool_check counts the slots that were not)."""
    (res,) = arm.run([("pool_check", [], [300, 37, 4], [])])
    assert res.rc == 0
