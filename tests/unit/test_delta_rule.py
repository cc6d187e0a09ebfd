"""Qwen3.5's linear attention over a step (services/gpu_worker/layers/delta_rule.py), both
paths (the C kernels and torch's ops), against transformers' own functions: the causal conv
(causal_conv1d_update / causal_conv1d_fn), the gated delta rule (torch_chunk_gated_delta_rule /
torch_recurrent_gated_delta_rule, use_qk_l2norm_in_kernel=True) and Qwen3_5RMSNormGated.

Steps mix requests of 1, 2, 3, 64 and 100 rows, fresh and continuing, in slots out of order,
with Hk != Hv and Dk != Dv. And the property the engine relies on: a prompt cut into chunks of
any sizes (inside the conv window too), its chunks in different steps beside other requests,
gives the outputs and final states it gives whole, to float rounding.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import delta_rule
from services.gpu_worker.layers.delta_rule import StateBatch, causal_conv, gated_delta, gated_rms_norm

PATHS = [pytest.param("c", marks=pytest.mark.kernels), "torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Which path the functions take: "c" (skips without the kernels; the torch fallbacks then
    fail the test) or "torch" (the CUDA build's)."""
    if request.param == "c" and cpu_kernels.library() is None:
        pytest.skip("no C compiler: the CPU kernels did not build")
    monkeypatch.setattr(delta_rule, "C_KERNELS", request.param == "c")
    if request.param == "c":  # every input here is one the kernels take: a fallback would be a bug
        for fallback in ("_conv_torch", "_delta_torch", "_norm_torch"):
            monkeypatch.setattr(delta_rule, fallback, _refused(fallback))
    return request.param


def _refused(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"the C path fell back to {name}")
    return fail


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-5) -> None:
    """Max abs difference within `rel` of the reference's scale (float32 rounding, summed in another order)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= rel * scale, f"max abs diff {err:.3g} (scale {scale:.3g})"


def make_batch(lens: list[int], fresh: list[bool], pool: int, seed: int) -> StateBatch:
    """A step of requests with `lens` rows each, in distinct random slots of a pool of `pool`."""
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    slots = random.Random(seed).sample(range(pool), len(lens))
    return StateBatch.build(bounds, slots, fresh)


def delta_inputs(t: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    """Random q, k, v and a g, beta as the model makes them (g = -A softplus(a + dt), beta = sigmoid(b))."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    a_log = torch.empty(hv).uniform_(0.01, 16, generator=gen).log()
    g = -a_log.exp() * F.softplus(torch.randn(t, hv, generator=gen) - 2)
    beta = torch.randn(t, hv, generator=gen).sigmoid()
    return q, k, v, g, beta


CASES = {  # lens, fresh
    "decode1": ([1], [False]),
    "two": ([2], [True]),
    "three": ([3], [False]),
    "chunk64": ([64], [True]),
    "hundred": ([100], [False]),
    "mixed": ([1, 100, 3, 1, 64, 2, 1], [False, True, False, True, False, True, False]),
    "decode_batch": ([1] * 5, [False, False, True, False, False]),
}


# ------------------------------------------------------------------------------- causal conv


def conv_reference(x, old_state, weight, batch):
    """transformers' causal_conv1d_update per request ([1, C, n] against its [1, C, K-1]
    window: zeros when fresh); the outputs and the pool after."""
    out, state = torch.zeros_like(x), old_state.clone()
    for i, (lo, hi) in enumerate(zip(batch.bounds, batch.bounds[1:])):
        window = torch.zeros_like(state[0]) if batch.fresh[i] else state[batch.slots[i]].clone()
        window = window.T.contiguous()[None]  # [1, C, K-1]
        out[lo:hi] = hf.causal_conv1d_update(x[lo:hi].T[None], window, weight, activation="silu")[0].T
        state[batch.slots[i]] = window[0].T
    return out, state


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("channels", [40, 300])
def test_causal_conv_matches_transformers(path, case, channels):
    lens, fresh = CASES[case]
    k, pool = 4, 9
    batch = make_batch(lens, fresh, pool, seed=channels)
    gen = torch.Generator().manual_seed(len(lens) + channels)
    x = torch.randn(batch.bounds[-1], channels, generator=gen)
    weight = torch.randn(channels, k, generator=gen) * 0.5
    state = torch.randn(pool, k - 1, channels, generator=gen)
    state[[s for s, f in zip(batch.slots, fresh) if f]] = float("nan")  # a fresh slot's old contents are never read
    want, want_state = conv_reference(x, state, weight, batch)
    out = causal_conv(x, state, weight, batch)
    close(out, want)
    close(state, want_state)
    assert not state.isnan().any()


def test_causal_conv_fresh_is_transformers_prefill(path):
    """A fresh request's conv is causal_conv1d_fn's (the no-cache prefill), its window its last K-1 inputs."""
    torch.manual_seed(3)
    x, weight, state = torch.randn(10, 64), torch.randn(64, 4), torch.zeros(2, 3, 64)
    batch = StateBatch.build([0, 10], [1], [True])
    out = causal_conv(x, state, weight, batch)
    close(out, hf.causal_conv1d_fn(x.T[None], weight, activation="silu")[0].T)
    assert torch.equal(state[1], x[-3:]) and torch.equal(state[0], torch.zeros(3, 64))


def test_causal_conv_takes_a_strided_x_and_pool_view(path):
    """x as a column slice of a wider projection, the state as a view of a bigger pool (its
    slots a stride apart): what the model passes."""
    torch.manual_seed(4)
    wide = torch.randn(7, 100)
    x = wide[:, 10:74]
    big = torch.randn(5, 2, 3, 64)
    state = big[:, 1]  # [5, 3, 64], slot stride 2 * 3 * 64
    weight = torch.randn(64, 4)
    batch = StateBatch.build([0, 2, 7], [4, 0], [False, False])
    want, want_state = conv_reference(x.contiguous(), state.clone(), weight, batch)
    before = big[:, 0].clone()
    close(causal_conv(x, state, weight, batch), want)
    close(state, want_state)
    assert torch.equal(big[:, 0], before)


# ------------------------------------------------------------------------------- gated delta rule


def delta_reference(q, k, v, g, beta, old_state, batch):
    """transformers per request: the recurrent form for one row (as its decode), else the
    chunked form; the outputs and the pool after."""
    out = torch.zeros(v.shape)
    state = old_state.clone()
    for i, (lo, hi) in enumerate(zip(batch.bounds, batch.bounds[1:])):
        slot = batch.slots[i]
        init = None if batch.fresh[i] else state[slot][None].clone()
        fn = hf.torch_recurrent_gated_delta_rule if hi - lo == 1 else hf.torch_chunk_gated_delta_rule
        o, s = fn(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi],
                  initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
        out[lo:hi], state[slot] = o[0], s[0]
    return out, state


HEADS = {  # hk, hv, dk, dv
    "grouped": (2, 4, 32, 48),
    "square": (2, 2, 16, 16),
    "wide_v": (1, 3, 8, 24),
    "qwen_head": (1, 2, 128, 128),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_gated_delta_matches_transformers(path, case, heads):
    lens, fresh = CASES[case]
    hk, hv, dk, dv = HEADS[heads]
    pool = 9
    batch = make_batch(lens, fresh, pool, seed=len(case) + dk)
    q, k, v, g, beta = delta_inputs(batch.bounds[-1], hk, hv, dk, dv, seed=dv + len(lens))
    state = torch.randn(pool, hv, dk, dv) * 0.2
    state[[s for s, f in zip(batch.slots, fresh) if f]] = float("nan")
    want, want_state = delta_reference(q, k, v, g, beta, state, batch)
    out = gated_delta(q, k, v, g, beta, state, batch)
    close(out, want)
    close(state, want_state)
    assert not state.isnan().any()


def test_gated_delta_takes_views_of_the_conv_output(path):
    """q, k, v as head views of one [T, 2 Hk Dk + Hv Dv] row (torch.split of the conv output),
    g and beta as columns of a wider tensor: the C path reads them in place."""
    hk, hv, dk, dv = 2, 4, 16, 8
    t = 9
    gen = torch.Generator().manual_seed(5)
    mixed = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen)
    qf, kf, vf = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = qf.view(t, hk, dk), kf.view(t, hk, dk), vf.view(t, hv, dv)
    ab = torch.randn(t, 2 * hv, generator=gen)
    g, beta = -F.softplus(ab[:, :hv]), ab[:, hv:].sigmoid()
    state = torch.randn(3, hv, dk, dv, generator=gen) * 0.2
    batch = StateBatch.build([0, 1, 9], [2, 0], [False, False])
    want, want_state = delta_reference(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                       beta.contiguous(), state, batch)
    close(gated_delta(q, k, v, g, beta, state, batch), want)
    close(state, want_state)


def test_an_empty_fresh_request_zeroes_its_slot(path):
    state = torch.randn(3, 2, 8, 8)
    keep = state[[0, 2]].clone()
    q, k, v, g, beta = delta_inputs(0, 1, 2, 8, 8, seed=0)
    out = gated_delta(q, k, v, g, beta, state, StateBatch.build([0, 0], [1], [True]))
    assert out.shape == (0, 2, 8)
    assert torch.equal(state[1], torch.zeros(2, 8, 8)) and torch.equal(state[[0, 2]], keep)


# ------------------------------------------------------------------------------- chunking


def layer(x, conv_w, conv_state, g, beta, state, batch, hk, dk, hv, dv):
    """The linear attention's core as the model runs it: conv, split into heads, delta rule."""
    mixed = causal_conv(x, conv_state, conv_w, batch)
    qf, kf, vf = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
    t = x.shape[0]
    return gated_delta(qf.view(t, hk, dk), kf.view(t, hk, dk), vf.view(t, hv, dv), g, beta, state, batch)


def test_a_prompt_cut_anywhere_gives_what_it_gives_whole(path):
    """Three prompts (130, 7 and 70 rows), each cut into random chunks (1-row chunks inside
    the conv window included), the chunks of all three spread over steps beside decode-like
    rows of a fourth request; outputs and final states against each prompt whole in one step."""
    hk, hv, dk, dv, kern = 2, 4, 16, 32, 4
    c = 2 * hk * dk + hv * dv
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    lens = [130, 7, 70]
    xs = [torch.randn(n, c, generator=gen) for n in lens]
    gs = [-F.softplus(torch.randn(n, hv, generator=gen) - 1) for n in lens]
    betas = [torch.rand(n, hv, generator=gen) for n in lens]
    conv_w = torch.randn(c, kern, generator=gen) * 0.5

    pool = 6
    whole_conv, whole_state = torch.zeros(pool, kern - 1, c), torch.zeros(pool, hv, dk, dv)
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    whole = layer(torch.cat(xs), conv_w, whole_conv, torch.cat(gs), torch.cat(betas), whole_state,
                  StateBatch.build(bounds, [3, 0, 5], [True] * 3), hk, dk, hv, dv)

    cuts = []
    for n in lens:
        sizes = [1, 2, 1] if n == 7 else []  # inside the window, then the rest
        while sum(sizes) < n:
            sizes.append(min(rng.choice([1, 2, 3, 17, 64, 65]), n - sum(sizes)))
        cuts.append(sizes)
    conv_state = torch.full((pool, kern - 1, c), float("nan"))  # slots start as garbage: fresh never reads them
    state = torch.full((pool, hv, dk, dv), float("nan"))
    done = [0, 0, 0]
    outs: list[list[torch.Tensor]] = [[], [], []]
    step = 0
    while any(cuts):
        reqs = [i for i in range(3) if cuts[i] and rng.random() < 0.7] or [next(i for i in range(3) if cuts[i])]
        rng.shuffle(reqs)
        rows, gg, bb, rb, slots, fresh = [], [], [], [0], [], []
        for i in reqs:
            n = cuts[i].pop(0)
            lo = done[i]
            rows.append(xs[i][lo:lo + n])
            gg.append(gs[i][lo:lo + n])
            bb.append(betas[i][lo:lo + n])
            rb.append(rb[-1] + n)
            slots.append([3, 0, 5][i])
            fresh.append(lo == 0)
        # a fourth request decoding one row per step in slot 1, beside them
        rows.append(torch.randn(1, c, generator=gen))
        gg.append(-torch.rand(1, hv, generator=gen))
        bb.append(torch.rand(1, hv, generator=gen))
        rb.append(rb[-1] + 1)
        slots.append(1)
        fresh.append(step == 0)
        o = layer(torch.cat(rows), conv_w, conv_state, torch.cat(gg), torch.cat(bb), state,
                  StateBatch.build(rb, slots, fresh), hk, dk, hv, dv)
        for j, i in enumerate(reqs):
            outs[i].append(o[rb[j]:rb[j + 1]])
            done[i] += rb[j + 1] - rb[j]
        step += 1
    assert step > 3
    for i, slot in enumerate([3, 0, 5]):
        lo, hi = bounds[i], bounds[i + 1]
        close(torch.cat(outs[i]), whole[lo:hi], rel=3e-5)
        close(state[slot], whole_state[slot], rel=3e-5)
        close(conv_state[slot], whole_conv[slot], rel=0)


@pytest.mark.kernels
def test_the_c_and_torch_paths_agree(monkeypatch):
    """The same step through both paths (a cross-check independent of transformers' forms)."""
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: the CPU kernels did not build")
    batch = make_batch([5, 1, 70, 1], [False, True, False, False], 6, seed=1)
    q, k, v, g, beta = delta_inputs(batch.bounds[-1], 2, 4, 64, 32, seed=1)
    state = torch.randn(6, 4, 64, 32) * 0.2
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for use_c in (True, False):
        monkeypatch.setattr(delta_rule, "C_KERNELS", use_c)
        s = state.clone()
        outs.append((gated_delta(q, k, v, g, beta, s, batch), s))
    close(outs[0][0], outs[1][0])
    close(outs[0][1], outs[1][1])


def test_bfloat16_takes_the_torch_path_in_float32():
    """What the CUDA build passes (bfloat16 activations, a float32 state pool): computed in
    float32, returned in the input's dtype, within bfloat16's rounding of the float32 step."""
    batch = StateBatch.build([0, 1, 70, 72], [2, 0, 1], [False, True, False])
    q, k, v, g, beta = delta_inputs(72, 2, 4, 32, 16, seed=11)
    state = torch.randn(3, 4, 32, 16) * 0.2
    s32, s16 = state.clone(), state.clone()
    o32 = gated_delta(q, k, v, g, beta, s32, batch)
    o16 = gated_delta(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, s16, batch)
    assert o16.dtype == torch.bfloat16 and s16.dtype == torch.float32
    close(o16.float(), o32, rel=2e-2)
    close(s16, s32, rel=2e-2)


# ------------------------------------------------------------------------------- gated RMSNorm


@pytest.mark.parametrize("shape", [(1, 16, 128), (3, 4, 24), (200, 2, 64)])
def test_gated_rms_norm_matches_transformers(path, shape):
    torch.manual_seed(shape[0])
    d = shape[-1]
    x, z = torch.randn(shape) * 3, torch.randn(shape) * 4
    z.view(-1)[:3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps
    norm = hf.Qwen3_5RMSNormGated(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d))
        want = norm(x, z)
    close(gated_rms_norm(x, z, norm.weight.detach(), 1e-6), want)


def test_gated_rms_norm_takes_a_strided_gate(path):
    """z as a column slice of a wider projection (in_proj_z fused with others)."""
    torch.manual_seed(9)
    x, wide, w = torch.randn(5, 3, 16), torch.randn(5, 3 * 16 + 8), torch.randn(16)
    z = wide[:, :48].view(5, 3, 16)
    want = gated_rms_norm(x, z.contiguous(), w, 1e-6)
    close(gated_rms_norm(x, z, w, 1e-6), want, rel=0)


# ------------------------------------------------------------------------------- StateBatch


def test_state_batch_refuses_what_would_write_out_of_bounds():
    with pytest.raises(ValueError):
        StateBatch.build([0, 2], [0, 1], [True])  # bounds and slots disagree
    with pytest.raises(ValueError):
        StateBatch.build([0, 2, 1], [0, 1], [True, True])  # decreasing
    with pytest.raises(ValueError):
        StateBatch.build([0, 1, 2], [1, 1], [True, True])  # one slot twice
    batch = StateBatch.build([0, 1, 2], [0, 4], [True, False])
    with pytest.raises(ValueError):
        causal_conv(torch.randn(2, 8), torch.zeros(4, 3, 8), torch.randn(8, 4), batch)  # slot 4 of 4
    with pytest.raises(ValueError):
        causal_conv(torch.randn(1, 8), torch.zeros(5, 3, 8), torch.randn(8, 4), batch)  # rows up to 2 of 1
    assert batch.meta.tolist() == [[0, 1, 0, 1], [1, 2, 4, 0]]
