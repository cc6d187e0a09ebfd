"""`services.gpu_worker.gguf_qwen35` undoes what llama.cpp's converter does to Qwen3.5's tensors
(conversion/qwen.py, imitated here on small arrays so it runs without the converter; the e2e
test_hybrid_gguf runs the converter itself): the value heads' tiled order, also on a
quantized matrix's raw blocks, A = -exp(A_log), the (1 + w) norms, the names."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.gpu_worker.gguf_qwen35 import Qwen35Tensors, a_log, hf_name

Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32


def _tiled(x: np.ndarray, axis: int, key_heads: int, per_key: int, head: int) -> np.ndarray:
    """The converter's `_reorder_v_heads`: grouped by key head -> tiled."""
    x = np.moveaxis(x, axis, 0)
    shape = x.shape
    x = x.reshape(key_heads, per_key, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(x, 0, axis)


def _config(value_head_dim: int) -> dict:
    return {"num_hidden_layers": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
            "linear_key_head_dim": 8, "linear_value_head_dim": value_head_dim}


def _convert(t: Qwen35Tensors, name: str, w: np.ndarray, qtype=F32, deq=None):
    return t.hf_tensor(name, w, qtype, deq or (lambda: w))


@pytest.mark.parametrize("dv", [16, 32])
def test_value_heads_back_in_hf_order(dv):
    rng = np.random.default_rng(0)
    t = Qwen35Tensors(_config(dv))
    hidden, key_dim, value_dim = 64, 16, 6 * dv
    qkv = rng.standard_normal((2 * key_dim + value_dim, hidden), dtype=np.float32)
    stored = np.concatenate([qkv[: 2 * key_dim], _tiled(qkv[2 * key_dim :], 0, 2, 3, dv)])
    assert np.array_equal(_convert(t, "blk.0.attn_qkv.weight", stored)[1], qkv)
    z = rng.standard_normal((value_dim, hidden), dtype=np.float32)
    assert np.array_equal(_convert(t, "blk.0.attn_gate.weight", _tiled(z, 0, 2, 3, dv))[1], z)
    for name in ("blk.1.ssm_alpha.weight", "blk.1.ssm_beta.weight"):
        ab = rng.standard_normal((6, hidden), dtype=np.float32)
        assert np.array_equal(_convert(t, name, _tiled(ab, 0, 2, 3, 1))[1], ab)
    dt = rng.standard_normal(6, dtype=np.float32)
    name, got = _convert(t, "blk.0.ssm_dt.bias", _tiled(dt, 0, 2, 3, 1))
    assert name == "model.layers.0.linear_attn.dt_bias" and np.array_equal(got, dt)
    a = (-torch.exp(torch.from_numpy(dt))).numpy()  # torch's exp, as the converter's and the model's
    got = _convert(t, "blk.0.ssm_a", _tiled(a, 0, 2, 3, 1))[1]
    assert np.array_equal((-torch.exp(torch.from_numpy(got))).numpy(), a)
    conv = rng.standard_normal((2 * key_dim + value_dim, 4), dtype=np.float32)  # squeezed [C, K]
    stored = np.concatenate([conv[: 2 * key_dim], _tiled(conv[2 * key_dim :], 0, 2, 3, dv)])
    name, got = _convert(t, "blk.0.ssm_conv1d.weight", stored)
    assert name == "model.layers.0.linear_attn.conv1d.weight" and np.array_equal(got, conv[:, None, :])
    out = rng.standard_normal((hidden, value_dim), dtype=np.float32)
    assert np.array_equal(_convert(t, "blk.0.ssm_out.weight", _tiled(out, 1, 2, 3, dv))[1], out)


@pytest.mark.parametrize("dv", [16, 32])
def test_quantized_blocks_move_whole(dv):
    """Rows of raw Q8_0 blocks move as rows; `ssm_out`'s columns move as whole blocks where a
    value head is whole blocks (32), else it comes dequantized: either way the values are the
    file's dequantized values in HF's order."""
    rng = np.random.default_rng(1)
    t = Qwen35Tensors(_config(dv))
    hidden, value_dim = 64, 6 * dv
    out = rng.standard_normal((hidden, value_dim), dtype=np.float32)
    raw = gguf.quants.quantize(_tiled(out, 1, 2, 3, dv), Q8)
    deq = gguf.quants.dequantize(raw, Q8).reshape(hidden, value_dim)
    got = _convert(t, "blk.0.ssm_out.weight", raw, Q8, lambda: deq)[1]
    if dv % 32 == 0:
        assert got.dtype == np.uint8
        got = gguf.quants.dequantize(got, Q8).reshape(hidden, value_dim)
    else:
        assert got.dtype == np.float32
    assert np.array_equal(got, deq[:, t.rows])
    z = rng.standard_normal((value_dim, hidden), dtype=np.float32)
    raw = gguf.quants.quantize(_tiled(z, 0, 2, 3, dv), Q8)
    got = _convert(t, "blk.0.attn_gate.weight", raw, Q8)[1]
    assert got.dtype == np.uint8
    assert np.array_equal(gguf.quants.dequantize(got, Q8).reshape(value_dim, hidden),
                          gguf.quants.dequantize(raw, Q8).reshape(value_dim, hidden)[t.rows])


def test_a_log_gives_the_files_a_back_exactly():
    """The model computes -exp(A_log) in float32: the A_log read back gives the file's A."""
    want = torch.linspace(-6, 3, 4001, dtype=torch.float32)
    a = -torch.exp(want)  # the converter's -exp(A_log)
    got = torch.from_numpy(a_log(a.numpy()))
    assert torch.equal(-torch.exp(got), a)


def test_norms_lose_the_converters_one_exactly():
    w = torch.from_numpy(np.random.default_rng(2).normal(0, 0.6, 4096).astype(np.float32))
    stored = w + 1.0  # the converter's (1 + w)
    t = Qwen35Tensors(_config(16))
    for name in ("blk.0.attn_norm.weight", "blk.1.post_attention_norm.weight", "output_norm.weight",
                 "blk.1.attn_q_norm.weight"):
        got = torch.from_numpy(_convert(t, name, stored.numpy())[1])
        assert torch.equal(got + 1.0, w + 1.0), name  # what Qwen35LM.load_weights folds in
    # the linear layers' gated norm is stored as is
    assert np.array_equal(_convert(t, "blk.0.ssm_norm.weight", w.numpy())[1], w.numpy())


def test_names():
    assert hf_name("blk.3.ssm_a", 4) == "model.layers.3.linear_attn.A_log"
    assert hf_name("blk.0.attn_qkv.weight", 4) == "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert hf_name("blk.0.post_attention_norm.weight", 4) == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.3.attn_q.weight", 4) == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("output.weight", 4) == "lm_head.weight"
    assert hf_name("blk.4.nextn.eh_proj.weight", 4) is None  # a multi-token prediction layer
    assert hf_name("blk.4.attn_q.weight", 4) is None
    with pytest.raises(KeyError):
        hf_name("blk.0.ssm_in.weight", 4)  # Qwen3-Next's unsplit in_proj_qkvz (the converter splits it)
    assert hf_name("blk.0.ssm_ba.weight", 4) == "model.layers.0.linear_attn.in_proj_ba.weight"  # a qwen3next file's
