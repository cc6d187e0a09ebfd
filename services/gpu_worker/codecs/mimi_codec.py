"""Mimi's decoder (kyutai's codec, CSM's): codes -> 24 kHz sound, streamed exactly.

transformers' `MimiModel.decode` is the reference (tests/unit/test_mimi_codec.py); this is
its decoder half in plain torch (transformers is not a runtime dependency), loading the
same weights (`codec_model.*` of a CSM checkpoint, or a Mimi checkpoint's flat names):

    codes [K, n] -> split RVQ (semantic + acoustic codebooks, summed, 1x1 projections)
    -> upsample (transposed conv, 12.5 -> 25 Hz) -> transformer (causal, sliding window)
    -> SEANet decoder (causal convs, transposed convs x8 x6 x5 x4) -> 1920 samples a frame

Every part is causal: a transposed conv's output is trimmed on the right by its overlap,
a conv is padded on the left only, and the transformer attends to the past. So the samples
of frame i depend on frames 0..i alone, and a stream can emit each frame's samples as soon
as it has them: `MimiStream` carries every part's state across pushes (each conv's last
inputs, each transposed conv's overlap tail, the transformer's keys and values inside its
window, the position), so the chunks concatenate to `MimiModel.decode` of all the frames
(up to float rounding: the sums are the same, grouped differently).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

PREFIX = "codec_model."
EPSILON = 1e-5  # MimiEuclideanCodebook's clamp of cluster usage


class MimiSettings:
    """The decoder's shape, from a Mimi config dict (`CsmConfig.codec_config`)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.sample_rate = int(cfg.get("sampling_rate", 24000))
        self.ratios = [int(r) for r in cfg.get("upsampling_ratios") or (8, 6, 5, 4)]
        self.hidden = int(cfg.get("hidden_size", 512))
        self.filters = int(cfg.get("num_filters", 64))
        self.res_layers = int(cfg.get("num_residual_layers", 1))
        self.kernel = int(cfg.get("kernel_size", 7))
        self.last_kernel = int(cfg.get("last_kernel_size", 3))
        self.res_kernel = int(cfg.get("residual_kernel_size", 3))
        self.growth = int(cfg.get("dilation_growth_rate", 2))
        self.compress = int(cfg.get("compress", 2))
        self.codebook_size = int(cfg.get("codebook_size", 2048))
        self.quantizers = int(cfg.get("num_quantizers", 32))
        self.semantic = int(cfg.get("num_semantic_quantizers", 1))
        self.layers = int(cfg.get("num_hidden_layers", 8))
        self.heads = int(cfg.get("num_attention_heads", 8))
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden // self.heads)
        self.window = int(cfg.get("sliding_window", 250))
        self.eps = float(cfg.get("norm_eps", 1e-5))
        rope = cfg.get("rope_parameters") or {}
        self.theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if cfg.get("hidden_act", "gelu") != "gelu" or not cfg.get("use_causal_conv", True) \
                or cfg.get("use_conv_shortcut", False) or rope.get("rope_type", "default") != "default":
            raise ValueError("only Mimi's own decoder is implemented: causal convs, no conv shortcut, GELU, "
                             "default RoPE")
        hop = math.prod(self.ratios)
        self.stride = int(math.ceil(self.sample_rate / hop) / (self.sample_rate / (hop * 2)))  # 25 Hz / 12.5 Hz
        self.samples_per_frame = hop * self.stride


#: the names of the decoder's tensors (the encoder's are `mimi_encoder.ENCODER_PARTS`)
DECODER_PARTS = ("quantizer.", "upsample.", "decoder_transformer.", "decoder.")


def _load(path: Path, wanted: tuple[str, ...] = DECODER_PARTS) -> dict[str, torch.Tensor]:
    """The codec's tensors named `wanted` from the folder's safetensors, prefix stripped."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = key[len(PREFIX):] if key.startswith(PREFIX) else key
                if name.startswith(wanted):
                    out[name] = f.get_tensor(key).float()
    if not out:
        raise ValueError(f"{path}: no Mimi weights (codec_model.* or Mimi's own names) in its safetensors")
    return out


def codebook_tables(w: Mapping[str, torch.Tensor], s: MimiSettings) -> list[torch.Tensor]:
    """Each codebook's centroids [codebook_size, dim], semantic first (transformers'
    `MimiEuclideanCodebook.embed`: the sums over the usage, clamped)."""
    names = [("semantic", i) for i in range(s.semantic)] + [("acoustic", i) for i in range(s.quantizers - s.semantic)]
    out = []
    for kind, i in names:
        base = f"quantizer.{kind}_residual_vector_quantizer.layers.{i}.codebook."
        out.append(w[base + "embed_sum"] / w[base + "cluster_usage"].clamp(min=EPSILON)[:, None])
    return out


class MimiCodec:
    """The decoder's weights, shared by every request's `MimiStream`."""

    def __init__(self, folder: str | Path, config: Mapping[str, Any]) -> None:
        self.s = MimiSettings(config)
        self.w = _load(Path(folder))
        self.codebook_size = self.s.codebook_size
        self.samples_per_frame = self.s.samples_per_frame
        self.sample_rate = self.s.sample_rate
        self.tables = codebook_tables(self.w, self.s)
        self.inv_freq = rope_inv_freq(self.s)
        self.seanet = self._seanet_plan()

    def _seanet_plan(self) -> list[tuple]:
        """The SEANet decoder's layers in order, as (kind, weight name, kernel, dilation, stride)."""
        s = self.s
        plan: list[tuple] = [("conv", "decoder.layers.0.conv", 1)]
        i = 1
        for ratio in s.ratios:
            plan += [("elu",), ("convT", f"decoder.layers.{i + 1}.conv", ratio)]
            i += 2
            for j in range(s.res_layers):
                plan.append(("res", f"decoder.layers.{i}.block", s.growth ** j))
                i += 1
        plan += [("elu",), ("conv", f"decoder.layers.{i + 1}.conv", 1)]
        return plan

    def stream(self, chunk_samples: int = 0) -> MimiStream:
        return MimiStream(self, chunk_samples)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """The whole clip of `codes` [frames, K] at once (a fresh stream, finished)."""
        st = self.stream()
        return np.concatenate([st.push(codes), st.finish()])


class MimiStream:
    """One request's decode state. `push(frames)` returns the samples the frames made
    final (all of theirs: everything is causal), gathered until `chunk_samples` are ready
    (0: every push); `finish` returns what is gathered."""

    def __init__(self, codec: MimiCodec, chunk_samples: int = 0) -> None:
        self.c = codec
        self.chunk = chunk_samples
        self.frames_received = 0
        self.pending: list[np.ndarray] = []
        self.state: dict[str, torch.Tensor] = {}
        self.keys: list[torch.Tensor | None] = [None] * codec.s.layers
        self.values: list[torch.Tensor | None] = [None] * codec.s.layers
        self.position = 0
        #: the request's audio has ended (an all-zero frame): later frames make no sound
        self.cut = False

    def push(self, frames: np.ndarray) -> np.ndarray:
        frames = np.asarray(frames, dtype=np.int64).reshape(-1, self.c.s.quantizers)
        if len(frames):
            if frames.min() < 0 or frames.max() >= self.c.codebook_size:
                raise ValueError(f"Mimi codes must be in [0, {self.c.codebook_size})")
            with torch.inference_mode():
                self.pending.append(self._decode(torch.from_numpy(frames)))
            self.frames_received += len(frames)
        if self.pending and sum(len(p) for p in self.pending) >= max(1, self.chunk):
            return self.finish()
        return np.zeros(0, dtype=np.float32)

    def finish(self) -> np.ndarray:
        out = np.concatenate(self.pending) if self.pending else np.zeros(0, dtype=np.float32)
        self.pending = []
        return out

    # -- the decoder, one chunk of frames ------------------------------------------------

    def _decode(self, frames: torch.Tensor) -> np.ndarray:
        x = self._dequantize(frames.t())  # [1, hidden, n]
        x = self._conv_t(x, "upsample.conv", self.c.s.stride, groups=self.c.s.hidden // self._groups_width())
        x = self._transformer(x.transpose(1, 2)).transpose(1, 2)
        for step in self.c.seanet:
            x = self._seanet_step(step, x)
        return x.reshape(-1).numpy().astype(np.float32)

    def _groups_width(self) -> int:
        return self.c.w["upsample.conv.weight"].shape[1]  # in-channels per group of the grouped conv

    def _dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """RVQ decode as transformers sums it: per half, 0 + each codebook's rows in order,
        then the half's output projection; semantic + acoustic."""
        sem = self.c.s.semantic
        out = None
        for kind, tables, rows in (("semantic", self.c.tables[:sem], codes[:sem]),
                                   ("acoustic", self.c.tables[sem:], codes[sem:])):
            if not len(rows):
                continue
            q = torch.full((), 0.0)
            for table, idx in zip(tables, rows):
                q = q + F.embedding(idx[None], table).permute(0, 2, 1)
            proj = self.c.w.get(f"quantizer.{kind}_residual_vector_quantizer.output_proj.weight")
            q = F.conv1d(q, proj) if proj is not None else q
            out = q if out is None else out + q
        assert out is not None
        return out

    def _conv(self, x: torch.Tensor, name: str, dilation: int = 1) -> torch.Tensor:
        """A causal conv (stride 1): the last (kernel - 1) * dilation inputs carried over,
        zeros before the first (transformers' left padding)."""
        w = self.c.w[name + ".weight"]
        keep = (w.shape[-1] - 1) * dilation
        past = self.state.get(name)
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], keep)
        full = torch.cat([past, x], dim=-1)
        self.state[name] = full[..., full.shape[-1] - keep:] if keep else full[..., :0]
        return F.conv1d(full, w, self.c.w.get(name + ".bias"), dilation=dilation)

    def _conv_t(self, x: torch.Tensor, name: str, stride: int, groups: int = 1) -> torch.Tensor:
        """A causal transposed conv: the samples past n * stride overlap the next chunk's
        first ones; they are carried over (bias left out: the next chunk adds its own)."""
        w, bias = self.c.w[name + ".weight"], self.c.w.get(name + ".bias")
        y = F.conv_transpose1d(x, w, bias, stride=stride, groups=groups)
        n = x.shape[-1] * stride
        tail = self.state.get(name)
        if tail is not None:
            y[..., : tail.shape[-1]] += tail
        rest = y[..., n:]
        self.state[name] = rest - bias[None, :, None] if bias is not None else rest.clone()
        return y[..., :n]

    def _seanet_step(self, step: tuple, x: torch.Tensor) -> torch.Tensor:
        kind = step[0]
        if kind == "elu":
            return F.elu(x)
        if kind == "conv":
            return self._conv(x, step[1])
        if kind == "convT":
            return self._conv_t(x, step[1], step[2])
        h = self._conv(F.elu(x), f"{step[1]}.1.conv", dilation=step[2])  # a residual block
        return x + self._conv(F.elu(h), f"{step[1]}.3.conv")

    def _transformer(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T, hidden] through the decoder transformer, positions continuing the
        stream's, each query seeing the keys of the last `sliding_window` positions."""
        s = self.c.s
        t = x.shape[1]
        pos = torch.arange(self.position, self.position + t)
        cos, sin = rope_tables(self.c.inv_freq, pos)
        for i in range(s.layers):
            x = transformer_layer(x, self.c.w, s, f"decoder_transformer.layers.{i}.",
                                  functools.partial(self._attend, i, cos=cos, sin=sin, pos=pos))
        self.position += t
        return x

    def _attend(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        s, w = self.c.s, self.c.w
        p = f"decoder_transformer.layers.{i}.self_attn."
        t = h.shape[1]
        q, k, v = project_qkv(h, w, s, p, cos, sin)
        past_k, past_v = self.keys[i], self.values[i]
        if past_k is not None and past_v is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        kpos = torch.arange(self.position + t - k.shape[2], self.position + t)
        keep = max(0, k.shape[2] - s.window)  # no later query sees these
        self.keys[i], self.values[i] = k[:, :, keep:], v[:, :, keep:]
        mask = (kpos[None] <= pos[:, None]) & (kpos[None] > pos[:, None] - s.window)
        return attend_out(q, k, v, mask, w, s, p)


def rope_inv_freq(s: MimiSettings) -> torch.Tensor:
    """The transformers' RoPE frequencies (HF's default rope)."""
    half = s.head_dim // 2
    return 1.0 / (s.theta ** (torch.arange(0, 2 * half, 2, dtype=torch.int64).float() / s.head_dim))


def rope_tables(inv_freq: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, head_dim] at positions `pos`."""
    freqs = pos[:, None].float() * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def transformer_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], s: MimiSettings, p: str,
                      attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One layer of Mimi's encoder or decoder transformer (`p`: its weights' prefix):
    layer-scaled attention (`attend` of the normed input: each side keeps its own keys)
    then the layer-scaled GELU MLP, as transformers' MimiTransformerLayer."""
    h = F.layer_norm(x, (s.hidden,), w[p + "input_layernorm.weight"], w[p + "input_layernorm.bias"], s.eps)
    x = x + w[p + "self_attn_layer_scale.scale"] * attend(h)
    h = F.layer_norm(x, (s.hidden,), w[p + "post_attention_layernorm.weight"],
                     w[p + "post_attention_layernorm.bias"], s.eps)
    mlp = F.linear(F.gelu(F.linear(h, w[p + "mlp.fc1.weight"])), w[p + "mlp.fc2.weight"])
    return x + w[p + "mlp_layer_scale.scale"] * mlp


def project_qkv(h: torch.Tensor, w: Mapping[str, torch.Tensor], s: MimiSettings, p: str, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (rotated) and v [1, heads, T, head_dim] of attention `p` for input h [1, T, hidden]."""
    t = h.shape[1]
    q = F.linear(h, w[p + "q_proj.weight"]).view(1, t, s.heads, s.head_dim).transpose(1, 2)
    k = F.linear(h, w[p + "k_proj.weight"]).view(1, t, s.kv_heads, s.head_dim).transpose(1, 2)
    v = F.linear(h, w[p + "v_proj.weight"]).view(1, t, s.kv_heads, s.head_dim).transpose(1, 2)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def attend_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               w: Mapping[str, torch.Tensor], s: MimiSettings, p: str) -> torch.Tensor:
    """Masked attention of q over k/v (GQA expanded) and attention `p`'s output projection."""
    rep = s.heads // s.kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.head_dim ** -0.5)
    return F.linear(o.transpose(1, 2).reshape(1, q.shape[2], -1), w[p + "o_proj.weight"])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
