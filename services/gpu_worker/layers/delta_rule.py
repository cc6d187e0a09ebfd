"""Qwen3.5's linear attention (Gated DeltaNet) over a step of several requests: the causal
conv over the q/k/v projection, the gated delta rule, and the gated RMSNorm after it.

Why not transformers' functions as they are: they take a padded [B, L, ...] batch that starts
from one cache, while a step here holds its requests' rows flattened one after the other
(`StateBatch.bounds`), each continuing its own state slot of a pool, and a step mixes
prefill chunks (many rows) with decode rows (one). So each function gathers the slots'
states, runs the step's requests together, and writes the final states back into their
slots in place. A request's first rows start from zeros (`fresh`: the slot's old contents
are never read, so a slot needs no clearing when it changes hands); any later rows continue
from the slot, so a prompt cut into chunks anywhere (even inside the conv window) gives what
it gives whole, to float rounding.

Two paths, the same results to float32 rounding (tests/unit/test_delta_rule.py compares both
with transformers' functions): the C kernels (kernels/delta_rule.c) for float32 tensors on
the CPU, and torch ops otherwise (the CUDA build, or no compiler): the recurrent form for the
one-row requests (decode), all of them at once, and the chunked WY form of
`torch_chunk_gated_delta_rule` for the others, their chunks batched across requests.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.gpu_worker import cpu_kernels

#: take the C kernels where they apply (float32 on the CPU); False runs the torch path
#: everywhere (the tests compare the two)
C_KERNELS = True
#: rows per chunk of the chunked form (transformers' chunk_size); a step whose longest
#: request is shorter takes the next power of two (at least 8): the same result, less padding
CHUNK = 64


@dataclass
class _ConvPlan:
    """The torch conv's gathers for one step and kernel size: each request's window and
    rows laid out one after the other in an `ext` buffer ([window | rows] per request)."""

    slots: torch.Tensor  # [B] int64
    fresh: torch.Tensor  # [B, 1, 1] bool
    win_pos: torch.Tensor  # [B * (K-1)]: where each window row goes in ext
    row_pos: torch.Tensor  # [rows]: where each of the step's rows goes in ext
    taps: list[torch.Tensor]  # K x [rows]: ext rows tap j of each output reads
    new_src: torch.Tensor  # [B * (K-1)]: ext rows that are each request's new window
    ext_rows: int


@dataclass
class _Decode:
    """The one-row requests of a step (the recurrent form, all at once)."""

    rows: torch.Tensor  # [n] their step rows
    slots: torch.Tensor  # [n]
    fresh: torch.Tensor  # [n, 1, 1, 1] bool


@dataclass
class _Chunked:
    """The multi-row requests of a step, longest first, their rows padded into chunks laid
    out chunk-major (chunk i of every request that has one, then chunk i + 1): scan step i
    then reads contiguous chunks and a prefix of the states."""

    slots: torch.Tensor  # [m]
    fresh: torch.Tensor  # [m, 1, 1, 1] bool
    src: torch.Tensor  # their step rows
    dest: torch.Tensor  # each one's position in the padded [chunks * cs] buffer
    cs: int  # rows per chunk
    chunks: int
    steps: list[tuple[int, int]]  # per scan step: (its first chunk, its chunks)


@dataclass
class _DeltaPlan:
    """The torch delta rule's gathers for one step."""

    decode: _Decode | None
    chunked: _Chunked | None
    empty_fresh: torch.Tensor | None  # slots of fresh requests with no rows (zeroed)


@dataclass
class StateBatch:
    """The requests of one step, as the linear-attention layers see them (built once per step, shared by layers)."""

    bounds: list[int]  # len B+1: request i's rows are [bounds[i], bounds[i+1]) of the step
    slots: list[int]  # len B: each request's state slot
    fresh: list[bool]  # len B: the slot's state starts at zero (the request's first rows)
    #: int64 [B, 4] (start, end, slot, fresh) per request: the C kernels' description of the step
    meta: torch.Tensor = field(init=False, repr=False, compare=False)
    _plans: dict[tuple[str, str], object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        b = len(self.slots)
        if len(self.bounds) != b + 1 or len(self.fresh) != b:
            raise ValueError(f"StateBatch: {len(self.bounds)} bounds, {b} slots, {len(self.fresh)} fresh flags")
        if any(hi < lo for lo, hi in zip(self.bounds, self.bounds[1:])) or (self.bounds and self.bounds[0] < 0):
            raise ValueError(f"StateBatch: bounds {self.bounds} are not non-decreasing from >= 0")
        if any(s < 0 for s in self.slots) or len(set(self.slots)) != b:
            raise ValueError(f"StateBatch: slots {self.slots} must be distinct and >= 0")
        rows = [[lo, hi, s, int(f)] for lo, hi, s, f in zip(self.bounds, self.bounds[1:], self.slots, self.fresh)]
        self.meta = torch.tensor(rows, dtype=torch.int64).reshape(b, 4)

    @classmethod
    def build(cls, bounds: Sequence[int], slots: Sequence[int], fresh: Sequence[bool]) -> StateBatch:
        """From any int sequences (a tensor's .tolist(), numpy ints, ranges)."""
        return cls([int(x) for x in bounds], [int(x) for x in slots], [bool(x) for x in fresh])

    @property
    def size(self) -> int:
        """Requests in the step."""
        return len(self.slots)

    def _check(self, rows: int, slots: int) -> None:
        """Out-of-range rows or slots would have the C kernels write outside their tensors."""
        if self.bounds and self.bounds[-1] > rows:
            raise ValueError(f"StateBatch: rows up to {self.bounds[-1]}, the step has {rows}")
        if self.slots and max(self.slots) >= slots:
            raise ValueError(f"StateBatch: slot {max(self.slots)} of a pool of {slots}")

    def _covers(self, rows: int) -> bool:
        """Every row of the step belongs to a request (else the others' outputs are zeros)."""
        return not self.bounds or (self.bounds[0] == 0 and self.bounds[-1] == rows)

    def conv_plan(self, k: int, device: torch.device) -> _ConvPlan:
        """The torch conv's index tensors on `device` (made once per step and kernel size)."""
        key = (f"conv{k}", str(device))
        plan = self._plans.get(key)
        if plan is None:
            w = k - 1
            win_pos: list[int] = []
            row_pos: list[int] = []
            new_src: list[int] = []
            at = 0
            for lo, hi in zip(self.bounds, self.bounds[1:]):
                n = hi - lo
                win_pos += range(at, at + w)
                row_pos += range(at + w, at + w + n)
                new_src += range(at + n, at + n + w)  # the last K-1 of [window | rows]
                at += w + n
            dev = functools.partial(torch.tensor, dtype=torch.int64, device=device)
            rows = dev(row_pos)
            plan = _ConvPlan(slots=dev(self.slots), fresh=torch.tensor(self.fresh, device=device).view(-1, 1, 1),
                             win_pos=dev(win_pos), row_pos=rows, taps=[rows - w + j for j in range(k)],
                             new_src=dev(new_src), ext_rows=at)
            self._plans[key] = plan
        assert isinstance(plan, _ConvPlan)
        return plan

    def delta_plan(self, device: torch.device) -> _DeltaPlan:
        """The torch delta rule's index tensors on `device` (made once per step)."""
        key = ("delta", str(device))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_delta_plan(device)
            self._plans[key] = plan
        assert isinstance(plan, _DeltaPlan)
        return plan

    def _make_delta_plan(self, device: torch.device) -> _DeltaPlan:
        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        def mask(flags: list[bool]) -> torch.Tensor:
            return torch.tensor(flags, dtype=torch.bool, device=device).view(-1, 1, 1, 1)

        reqs = list(zip(self.bounds, self.bounds[1:], self.slots, self.fresh))
        dec = [r for r in reqs if r[1] - r[0] == 1]
        long = sorted((r for r in reqs if r[1] - r[0] > 1), key=lambda r: r[0] - r[1])  # longest first
        empty = [r[2] for r in reqs if r[1] == r[0] and r[3]]
        plan = _DeltaPlan(decode=_Decode(dev([r[0] for r in dec]), dev([r[2] for r in dec]), mask([r[3] for r in dec]))
                          if dec else None, chunked=None, empty_fresh=dev(empty) if empty else None)
        if long:
            longest = long[0][1] - long[0][0]
            cs = CHUNK if longest >= CHUNK else max(8, 1 << (longest - 1).bit_length())
            counts = [(hi - lo + cs - 1) // cs for lo, hi, _, _ in long]
            steps, first = [], 0
            for i in range(counts[0]):
                active = sum(1 for c in counts if c > i)  # a prefix: counts are non-increasing
                steps.append((first, active))
                first += active
            src: list[int] = []
            dest: list[int] = []
            for r, (lo, hi, _, _) in enumerate(long):
                for p in range(hi - lo):
                    src.append(lo + p)
                    dest.append((steps[p // cs][0] + r) * cs + p % cs)
            plan.chunked = _Chunked(dev([r[2] for r in long]), mask([r[3] for r in long]), dev(src), dev(dest), cs,
                                    first, steps)
        return plan


def _lib(*tensors: torch.Tensor):
    """The C kernels, where they apply to these tensors (float32 on the CPU), else None."""
    if not C_KERNELS or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return cpu_kernels.library()


def _rows_ok(t: torch.Tensor, dims: int) -> bool:
    """t is [rows, ...] with everything but the row stride contiguous (a view of a wider
    GEMM output is fine: the C kernels take the row stride)."""
    if t.dim() != dims:
        return False
    inner = 1
    for d in range(dims - 1, 0, -1):
        if t.shape[d] != 1 and t.stride(d) != inner:
            return False
        inner *= t.shape[d]
    return True


def _load_states(pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The slots' states as a float32 copy, fresh ones zeros (masked, not multiplied: an
    unused slot may hold anything, NaN included)."""
    return pool.index_select(0, slots).float().masked_fill_(fresh, 0.0)


# ------------------------------------------------------------------------------- causal conv


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """x [T, C] (the in_proj_qkv output rows of the step), conv_state [S, K-1, C] (the pool's view, time-major:
    the last K-1 inputs of each slot, oldest first), weight [C, K] (conv1d.weight squeezed); returns silu(depthwise
    causal conv) [T, C], a fresh tensor, and writes each request's last K-1 inputs (taking from the old state when
    its rows are fewer than K-1) into its slot. fresh -> the request's old window is zeros."""
    t, c = x.shape
    k = weight.shape[1]
    batch._check(t, conv_state.shape[0])
    lib = _lib(x, conv_state, weight)
    if (lib is not None and x.stride(1) == 1 and weight.is_contiguous() and conv_state.dim() == 3
            and conv_state.shape[1:] == (k - 1, c) and _rows_ok(conv_state, 3)):
        out = torch.empty(t, c) if batch._covers(t) else torch.zeros(t, c)
        if batch.size == 0 or lib.mstar_causal_conv(x.data_ptr(), x.stride(0), c, conv_state.data_ptr(),
                                                    conv_state.stride(0), k, weight.data_ptr(),
                                                    batch.meta.data_ptr(), batch.size, out.data_ptr()) == 0:
            return out
    return _conv_torch(x, conv_state, weight, batch)


def _conv_torch(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """The conv as K shifted multiply-adds over [window | rows] of every request at once (in
    float32, as transformers' conv in the weight's float32)."""
    t, c = x.shape
    k = weight.shape[1]
    out = torch.zeros(t, c, dtype=x.dtype, device=x.device)
    if batch.size == 0:
        return out
    plan = batch.conv_plan(k, x.device)
    windows = conv_state.index_select(0, plan.slots).float().masked_fill_(plan.fresh, 0.0)
    ext = torch.empty(plan.ext_rows, c, dtype=torch.float32, device=x.device)
    ext.index_copy_(0, plan.win_pos, windows.reshape(-1, c))
    lo, hi = batch.bounds[0], batch.bounds[-1]
    ext.index_copy_(0, plan.row_pos, x[lo:hi].float())
    w = weight.float()
    acc = ext.index_select(0, plan.taps[0]) * w[:, 0]
    for j in range(1, k):
        acc.addcmul_(ext.index_select(0, plan.taps[j]), w[:, j])
    out[lo:hi] = F.silu(acc).to(x.dtype)
    new = ext.index_select(0, plan.new_src).view(batch.size, k - 1, c)
    conv_state.index_copy_(0, plan.slots, new.to(conv_state.dtype))
    return out


# ------------------------------------------------------------------------------- gated delta rule


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0), beta [T, Hv] float32; state [S, Hv, Dk, Dv] float32
    (the pool's view). As transformers with use_qk_l2norm_in_kernel=True: q and k L2-normalised (eps 1e-6, as its
    l2norm), q scaled by Dk**-0.5, each k head serving Hv // Hk consecutive v heads (repeat_interleave). Returns
    o [T, Hv, Dv] (fresh), and leaves each request's final state in its slot (fresh -> starts at zeros)."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if hv % hk or q.shape != k.shape or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"gated_delta: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"state {tuple(state.shape)}")
    batch._check(t, state.shape[0])
    lib = _lib(q, k, v, g, beta, state)
    if (lib is not None and _rows_ok(q, 3) and _rows_ok(k, 3) and _rows_ok(v, 3) and g.stride(-1) == 1
            and beta.stride(-1) == 1 and _rows_ok(state, 4)):
        out = torch.empty(t, hv, dv) if batch._covers(t) else torch.zeros(t, hv, dv)
        if batch.size == 0 or lib.mstar_gated_delta(
                q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), g.data_ptr(),
                g.stride(0), beta.data_ptr(), beta.stride(0), hk, hv, dk, dv, state.data_ptr(), state.stride(0),
                batch.meta.data_ptr(), batch.size, out.data_ptr()) == 0:
            return out
    return _delta_torch(q, k, v, g, beta, state, batch)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' l2norm (FLA's): x * rsqrt(sum x^2 + 1e-6)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _delta_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, batch: StateBatch) -> torch.Tensor:
    """The torch path, in float32: the decode rows in one recurrent step, the rest chunked."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    plan = batch.delta_plan(q.device)
    qn = _l2norm(q.float()) * dk ** -0.5
    kn = _l2norm(k.float())
    if hv != hk:
        qn = qn.repeat_interleave(hv // hk, dim=1)
        kn = kn.repeat_interleave(hv // hk, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.zeros(t, hv, dv, dtype=torch.float32, device=q.device)
    if (dec := plan.decode) is not None:
        s = _load_states(state, dec.slots, dec.fresh)
        out.index_copy_(0, dec.rows, _recurrent_step(qn[dec.rows], kn[dec.rows], vf[dec.rows], gf[dec.rows],
                                                     bf[dec.rows], s))
        state.index_copy_(0, dec.slots, s.to(state.dtype))
    if plan.chunked is not None:
        _chunked(qn, kn, vf, gf, bf, state, plan.chunked, out)
    if plan.empty_fresh is not None:
        state.index_fill_(0, plan.empty_fresh, 0.0)
    return out.to(q.dtype)


def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    s: torch.Tensor) -> torch.Tensor:
    """One token of each request ([n, Hv, D] each; g, beta [n, Hv]), s [n, Hv, Dk, Dv]
    updated in place: transformers' recurrent form. Returns o [n, Hv, Dv]."""
    s.mul_(g.exp()[..., None, None])
    kv = (k.unsqueeze(-2) @ s).squeeze(-2)
    delta = (v - kv) * beta.unsqueeze(-1)
    s.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ s).squeeze(-2)


def _chunked(qn: torch.Tensor, kn: torch.Tensor, vf: torch.Tensor, gf: torch.Tensor, bf: torch.Tensor,
             state: torch.Tensor, plan: _Chunked, out: torch.Tensor) -> None:
    """transformers' torch_chunk_gated_delta_rule over the multi-row requests at once: their
    rows padded into chunks (zeros after a request's last row, which change neither its
    outputs nor its state), the intra-chunk work batched over every chunk, then the scan
    over chunk index with the requests that still have a chunk."""
    cs, n = plan.cs, plan.chunks
    hv = vf.shape[1]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [chunks, Hv, cs, ...]
        buf = x.new_zeros((n * cs, *x.shape[1:]))
        buf.index_copy_(0, plan.dest, x.index_select(0, plan.src))
        return buf.view(n, cs, *x.shape[1:]).transpose(1, 2).contiguous()

    q, k, v, g, beta = pad(qn), pad(kn), pad(vf), pad(gf), pad(bf)
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    upper = torch.ones(cs, cs, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = _load_states(state, plan.slots, plan.fresh)
    o = torch.empty_like(new_values)
    for first, active in plan.steps:
        sl = slice(first, first + active)
        si = s[:active]
        v_new = new_values[sl] - k_cumdecay[sl] @ si
        o[sl] = q[sl] @ si + intra[sl] @ v_new
        s[:active] = si * chunk_decay[sl] + k[sl].transpose(-1, -2) @ v_new
    flat = o.transpose(1, 2).reshape(n * cs, hv, -1)
    out.index_copy_(0, plan.src, flat.index_select(0, plan.dest))
    state.index_copy_(0, plan.slots, s.to(state.dtype))


# ------------------------------------------------------------------------------- gated RMSNorm


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated over the last dim: rmsnorm(x) * weight * silu(z) (x, z [..., D])."""
    d = x.shape[-1]
    lib = _lib(x, z, weight)
    if lib is not None and weight.is_contiguous() and weight.numel() == d and z.shape == x.shape:
        x2, z2 = x.reshape(-1, d), z.reshape(-1, d)
        if x2.stride(1) == 1 and z2.stride(1) == 1:
            out = torch.empty(x2.shape[0], d)
            lib.mstar_gated_rms_norm(x2.data_ptr(), x2.stride(0), z2.data_ptr(), z2.stride(0), weight.data_ptr(),
                                     eps, out.data_ptr(), x2.shape[0], d)
            return out.view(x.shape)
    return _norm_torch(x, z, weight, eps)


def _norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated's ops as they are (in x's dtype where it casts back)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(z.float())).to(dtype)
