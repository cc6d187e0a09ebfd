"""Rotary position embeddings: every RoPE type transformers implements for the served
families, as cos / sin tables indexed by position.

Each type's inverse frequencies follow `transformers.modeling_rope_utils` operation for
operation (float32, the same order), so the tables are transformers' own
(tests/unit/test_rope.py compares them with `ROPE_INIT_FUNCTIONS`).

Two types change their frequencies with the sequence length at run time in transformers.
"dynamic" (NTK) recomputes the base for the current length once it passes the pretrained
context; transformers picks it per forward call from the batch's longest position, and a
cached key keeps the frequencies of the step that wrote it. Here the frequencies are a
function of the position alone: row p uses those transformers uses when p is the newest
position (length p + 1). That is exactly transformers' single-sequence generation whenever
the prompt fits the pretrained context, never depends on what else is in the batch, and
lets one table serve every request.

"longrope" (Phi-3 128k) switches from the short to the long factors past the pretrained
context, and transformers' Phi-3 `generate` then throws its cache away and recomputes the
whole sequence with the long factors. mstar never recomputes a request's KV: row p uses
the short factors below the pretrained context and the long ones from it on, the same
per-position rule. It is exact while a sequence stays inside the pretrained context (the
common case: 4k of a 128k model); past it, the rows before the switch keep the short
factors, where transformers would re-rotate them (vLLM picks short or long per batch).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.model_config import RopeConfig

#: rows the tables start with; they grow (doubling, up to the context) when a step needs more
INITIAL_ROWS = 4096


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (1 except for yarn and longrope)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.mscale and rope.mscale_all_dim:
            return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
        return mscale(rope.factor)
    if rope.rope_type == "longrope":
        orig = rope.original_max_position_embeddings
        return 1.0 if rope.factor <= 1.0 else math.sqrt(1 + math.log(rope.factor) / math.log(orig))
    return 1.0


def inv_freq(rope: RopeConfig, dim: int, seq_len: int | None = None) -> torch.Tensor:
    """The inverse frequencies [dim / 2] transformers uses for a sequence of `seq_len`
    (None: at initialisation, i.e. within the pretrained context)."""
    kind = rope.rope_type
    if kind == "default":
        return _base_inv_freq(rope.theta, dim)
    if kind == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor
    if kind == "dynamic":
        orig = rope.original_max_position_embeddings
        if seq_len is None or seq_len <= orig:
            base = rope.theta * ((rope.factor * orig / orig) - (rope.factor - 1)) ** (dim / (dim - 2))
            return _base_inv_freq(base, dim)
        # at run time transformers computes the base from a tensor length, in float32
        n = torch.tensor(seq_len, dtype=torch.int64)
        base = rope.theta * ((rope.factor * n / orig) - (rope.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim)
    if kind == "llama3":
        return _llama3(rope, dim)
    if kind == "freq_factors":  # llama.cpp's rope_freqs: theta_i / factor_i
        return _base_inv_freq(rope.theta, dim) / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if kind == "yarn":
        return _yarn(rope, dim)
    if kind == "longrope":
        long = seq_len is not None and seq_len > rope.original_max_position_embeddings
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * rope.theta**shape)
    raise ValueError(f"RoPE type {kind!r}")


def _llama3(rope: RopeConfig, dim: int) -> torch.Tensor:
    inv = _base_inv_freq(rope.theta, dim)
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    base, factor, orig = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return interpolation * (1 - extra_factor) + extrapolation * extra_factor


def position_inv_freq(rope: RopeConfig, dim: int, start: int, stop: int) -> torch.Tensor:
    """Inverse frequencies for positions [start, stop): [1, dim / 2] where they do not depend
    on the position, else one row per position (see the module docstring)."""
    orig = rope.original_max_position_embeddings
    if rope.rope_type not in ("dynamic", "longrope") or stop <= orig:
        return inv_freq(rope, dim).unsqueeze(0)
    rows = [inv_freq(rope, dim, p + 1 if p + 1 > orig else None) for p in range(start, stop)]
    return torch.stack(rows)


class Rotary(nn.Module):
    """HF's rotate_half RoPE with cos / sin tables by position, grown on demand up to
    `max_pos`. The sin table has its first half negated (see `apply_rope`)."""

    cos: torch.Tensor  # buffers (register_buffer)
    sin_signed: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_pos = rope, head_dim, max_pos
        self.scaling = attention_factor(rope)
        #: positions the tables hold (a plain int: read every decode step, where a buffer's
        #: shape is a module lookup and a tensor call)
        self.rows = 0
        self.register_buffer("cos", torch.empty(0, head_dim), persistent=False)
        self.register_buffer("sin_signed", torch.empty(0, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables; also called after building on the meta device."""
        if torch.empty(0).is_meta:
            return  # built on the meta device: the loader calls this again once the model is real
        rows = min(self.max_pos, INITIAL_ROWS)
        device = "cpu" if self.cos.is_meta else self.cos.device
        self.cos = torch.empty(0, self.head_dim, device=device)
        self.sin_signed = torch.empty(0, self.head_dim, device=device)
        self.rows = 0
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        start = self.cos.shape[0]
        pos = torch.arange(start, rows, dtype=torch.float32).unsqueeze(1)
        freqs = pos * position_inv_freq(self.rope, self.head_dim, start, rows)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        device, dtype = self.cos.device, self.cos.dtype
        self.cos = torch.cat((self.cos, cos.to(device, dtype)))
        self.sin_signed = torch.cat((self.sin_signed, sin_signed.to(device, dtype)))
        self.rows = self.cos.shape[0]

    def ensure(self, rows: int) -> None:
        """Tables for positions below `rows` (doubling, so a long sequence grows them a few
        times; never past `max_pos`)."""
        if rows > self.rows:
            self._grow(min(self.max_pos, max(rows, 2 * self.rows)))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows [T, 1, D] for this step's positions (once per step, not per layer)."""
        if positions.device.type == "cpu" and positions.numel():
            self.ensure(int(positions.max()) + 1)
        elif self.cos.shape[0] < self.max_pos:  # no host sync per step on an accelerator: the whole table
            self.ensure(self.max_pos)
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` with the sign of rotate_half's negated half
    folded into the table: (-x2) * s == x2 * (-s) exactly, so the result is bitwise HF's,
    in one cat and two multiplies instead of a neg, a cat and two multiplies."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos).add_(torch.cat((x2, x1), dim=-1).mul_(sin_signed))


class MRotary(Rotary):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): the same frequencies and tables as `Rotary`,
    but each row has three positions (temporal, height, width) and each rotary pair takes
    its angle from one of them: the first `section[0]` pairs from the temporal position,
    the next `section[1]` from the height, the rest from the width, the same split over
    the second half of the head (transformers' `apply_multimodal_rotary_pos_emb`).

    Every (position, pair) angle is a row of the 1-D table, so a step's cos / sin are a
    gather: column d of row t comes from table row `positions[stream(d), t]`. 1-D
    positions [T] (all three streams equal: a text-only row) take `Rotary`'s path."""

    streams: torch.Tensor  # buffer: [head_dim] stream index of each table column
    columns: torch.Tensor  # buffer: arange(head_dim), the gather's column index

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int, section: tuple[int, ...]) -> None:
        if sum(section) * 2 != head_dim:
            raise ValueError(f"mrope_section {list(section)} must sum to head_dim / 2 = {head_dim // 2}")
        self.section = tuple(section)  # a plain attribute: set before Module.__init__, which reset_buffers reads
        super().__init__(rope, head_dim, max_pos)

    def reset_buffers(self) -> None:
        """The tables and the column -> stream index (registered here, as the tables are
        made here: not on the meta device)."""
        super().reset_buffers()
        if torch.empty(0).is_meta:
            return
        half = [i % 3 for i, n in enumerate(self.section) for _ in range(n)]
        device = self.cos.device
        self.register_buffer("streams", torch.tensor(half * 2, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("columns", torch.arange(self.head_dim, device=device), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows [T, 1, D] for positions [3, T] (or [T])."""
        if positions.dim() == 1:
            return super().tables(positions, dtype)
        if positions.device.type == "cpu" and positions.numel():
            self.ensure(int(positions.max()) + 1)
        elif self.cos.shape[0] < self.max_pos:
            self.ensure(self.max_pos)
        rows = positions[self.streams].t()  # [T, D]: the table row of each (row, column)
        cols = self.columns
        return self.cos[rows, cols].unsqueeze(1).to(dtype), self.sin_signed[rows, cols].unsqueeze(1).to(dtype)
