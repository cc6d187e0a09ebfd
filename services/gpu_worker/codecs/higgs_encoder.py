"""Higgs Audio v2's codec encoder (bosonai/higgs-audio-v2-tokenizer, an X-codec): 24 kHz
sound -> frames of 8 codes, as transformers' `HiggsAudioV2TokenizerModel.encode` makes
them (tests/unit/test_higgs_encoder.py), in plain torch from the same weights: voice
cloning's reference clips, encoded at admission (runners/higgs.py).

    semantic: resample to 16 kHz (torchaudio's windowed-sinc `resample`, ported), pad 160
      each side, HuBERT (conv feature encoder, projection, positional conv, post-LN
      transformer), the mean of its hidden states, every `semantic_downsample_factor`-th
      row, then X-codec's semantic encoder (ELU residual convs);
    acoustic: the DAC encoder on the clip (padded by half a hop each side when its length
      would not match the semantic path's);
    both concatenated, `fc`, then the RVQ: each codebook the nearest code to the residual
      (through its `project_in`), the residual less its `project_out`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker.codecs.higgs_codec import DILATIONS, KERNEL, _snake, load_state

#: the encoder's tensors
ENCODER_PARTS = ("semantic_model.", "encoder_semantic.", "acoustic_encoder.", "fc.", "quantizer.")


def resample(x: torch.Tensor, orig: int, new: int, width_zeros: int = 6, rolloff: float = 0.99) -> torch.Tensor:
    """torchaudio.functional.resample's default ("sinc_interp_hann") of a 1-D signal."""
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    base = min(orig, new) * rolloff
    width = math.ceil(width_zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=x.dtype, device=x.device)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=x.dtype, device=x.device)[:, None, None] / new + idx
    t = (t * base).clamp_(-width_zeros, width_zeros)
    window = torch.cos(t * math.pi / width_zeros / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t) * window * (base / orig)
    out = F.conv1d(F.pad(x[None, None], (width, width + orig)), kernel, stride=orig)
    return out.transpose(1, 2).reshape(-1)[: math.ceil(new * x.numel() / orig)]


class HiggsEncoder:
    """The encoder of an X-codec config dict (the codec folder's config.json)."""

    def __init__(self, path: str | Path, config: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
        self.cfg = dict(config)
        self.acoustic = dict(config.get("acoustic_model_config") or {})
        self.semantic = dict(config.get("semantic_model_config") or {})
        self.sample_rate = int(config.get("sample_rate", 24000))
        self.semantic_rate = int(config.get("semantic_sample_rate", 16000))
        self.hop = math.prod(int(s) for s in self.acoustic.get("downsampling_ratios") or (8, 5, 4, 2, 3))
        self.stride = int(self.hop / (self.sample_rate / self.semantic_rate) / int(config.get("downsample_factor",
                                                                                              320)))
        self.device = torch.device(device)
        self.w = {k: v.to(self.device) for k, v in load_state(Path(path), ENCODER_PARTS).items()}
        self.num_quantizers = sum(1 for k in self.w if k.endswith(".codebook.embed"))
        if not any(k.startswith("semantic_model.") for k in self.w):
            raise ValueError(f"{path}: the codec was saved without its encoder (semantic_model.*)")

    def encode(self, samples: np.ndarray) -> np.ndarray:
        """Mono float32 samples at the codec's rate -> codes [frames, num_quantizers]."""
        with torch.inference_mode():
            x = torch.as_tensor(np.asarray(samples, dtype=np.float32), device=self.device)
            sem = self._semantic_encoder(self._semantic_features(x))
            ac = self._acoustic(x[None, None])
            if ac.shape[-1] != sem.shape[-1]:
                ac = self._acoustic(F.pad(x[None, None], (self.hop // 2, self.hop // 2)))
            emb = F.linear(torch.cat([ac, sem], dim=1)[0].t(), self.w["fc.weight"], self.w["fc.bias"])
            return self._quantize(emb).cpu().numpy()

    # -- semantic ----------------------------------------------------------------------

    def _semantic_features(self, x: torch.Tensor) -> torch.Tensor:
        """HuBERT's hidden states averaged [1, T, hidden], every `stride`-th row."""
        if self.sample_rate != self.semantic_rate:
            x = resample(x, self.sample_rate, self.semantic_rate)
        h = F.pad(x, (160, 160))[None, None]
        p = "semantic_model."
        strides = self.semantic.get("conv_stride") or (5, 2, 2, 2, 2, 2, 2)
        for i, s in enumerate(strides):
            c = f"{p}feature_extractor.conv_layers.{i}."
            h = F.conv1d(h, self.w[c + "conv.weight"], self.w.get(c + "conv.bias"), stride=int(s))
            if i == 0:
                h = F.group_norm(h, h.shape[1], self.w[c + "layer_norm.weight"], self.w[c + "layer_norm.bias"])
            h = F.gelu(h)
        h = h[0].t()
        eps = float(self.semantic.get("layer_norm_eps", 1e-5))
        h = F.layer_norm(h, h.shape[-1:], self.w[p + "feature_projection.layer_norm.weight"],
                         self.w[p + "feature_projection.layer_norm.bias"], eps)
        proj = p + "feature_projection.projection."
        h = F.linear(h, self.w[proj + "weight"], self.w[proj + "bias"])
        states = self._hubert_encoder(h, eps)
        return torch.stack(states).mean(dim=0)[:: max(1, self.stride)]

    def _hubert_encoder(self, h: torch.Tensor, eps: float) -> list[torch.Tensor]:
        """The positional conv and the post-LN layers; every hidden state (the layers'
        input and each layer's output), as `output_hidden_states` gives them."""
        p = "semantic_model.encoder."
        k = int(self.semantic.get("num_conv_pos_embeddings", 128))
        pos = F.conv1d(h.t()[None], self.w[p + "pos_conv_embed.conv.weight"], self.w[p + "pos_conv_embed.conv.bias"],
                       padding=k // 2, groups=int(self.semantic.get("num_conv_pos_embedding_groups", 16)))
        pos = pos[..., :-1] if k % 2 == 0 else pos
        h = h + F.gelu(pos)[0].t()
        h = F.layer_norm(h, h.shape[-1:], self.w[p + "layer_norm.weight"], self.w[p + "layer_norm.bias"], eps)
        states = [h]
        heads = int(self.semantic.get("num_attention_heads", 12))
        for i in range(int(self.semantic.get("num_hidden_layers", 12))):
            h = self._hubert_layer(h, f"{p}layers.{i}.", heads, eps)
            states.append(h)
        return states

    def _hubert_layer(self, h: torch.Tensor, p: str, heads: int, eps: float) -> torch.Tensor:
        def lin(name: str, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.w[p + name + ".weight"], self.w[p + name + ".bias"])

        t, d = h.shape
        q, k, v = (lin(f"attention.{n}_proj", h).view(t, heads, d // heads).transpose(0, 1) for n in "qkv")
        att = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(t, d)
        h = F.layer_norm(h + lin("attention.out_proj", att), (d,), self.w[p + "layer_norm.weight"],
                         self.w[p + "layer_norm.bias"], eps)
        h = h + lin("feed_forward.output_dense", F.gelu(lin("feed_forward.intermediate_dense", h)))
        return F.layer_norm(h, (d,), self.w[p + "final_layer_norm.weight"], self.w[p + "final_layer_norm.bias"], eps)

    def _semantic_encoder(self, feats: torch.Tensor) -> torch.Tensor:
        """X-codec's semantic encoder over [T, hidden] -> [1, hidden, T]."""
        p = "encoder_semantic."
        k = int(self.cfg.get("kernel_size", 3))
        unit = int(self.cfg.get("unit_kernel_size", 3))
        x = F.conv1d(feats.t()[None], self.w[p + "conv.weight"], padding=k // 2)
        for i, s in enumerate(self.cfg.get("strides") or (1, 1)):
            b = f"{p}conv_blocks.{i}."
            for j, d in enumerate(self.cfg.get("block_dilations") or (1, 1)):
                r = f"{b}res_units.{j}."
                y = F.conv1d(F.elu(x), self.w[r + "conv1.weight"], padding=(unit - 1) // 2 * int(d), dilation=int(d))
                x = x + F.conv1d(F.elu(y), self.w[r + "conv2.weight"])
            kern = 3 if int(s) == 1 else 2 * int(s)
            x = F.conv1d(x, self.w[b + "conv.weight"], self.w[b + "conv.bias"], stride=int(s), padding=(kern - 1) // 2)
        return x

    # -- acoustic and the quantizer ---------------------------------------------------------

    def _acoustic(self, x: torch.Tensor) -> torch.Tensor:
        """The DAC encoder: [1, 1, n] samples -> [1, hidden, frames]."""
        p = "acoustic_encoder."
        x = F.conv1d(x, self.w[p + "conv1.weight"], self.w[p + "conv1.bias"], padding=KERNEL // 2)
        for i, s in enumerate(self.acoustic.get("downsampling_ratios") or (8, 5, 4, 2, 3)):
            b = f"{p}block.{i}."
            for j, d in enumerate(DILATIONS, start=1):
                r = f"{b}res_unit{j}."
                y = F.conv1d(_snake(x, self.w[r + "snake1.alpha"]), self.w[r + "conv1.weight"],
                             self.w[r + "conv1.bias"], padding=(KERNEL - 1) * d // 2, dilation=d)
                x = x + F.conv1d(_snake(y, self.w[r + "snake2.alpha"]), self.w[r + "conv2.weight"],
                                 self.w[r + "conv2.bias"])
            x = F.conv1d(_snake(x, self.w[b + "snake1.alpha"]), self.w[b + "conv1.weight"], self.w[b + "conv1.bias"],
                         stride=int(s), padding=math.ceil(int(s) / 2))
        x = _snake(x, self.w[p + "snake1.alpha"])
        return F.conv1d(x, self.w[p + "conv2.weight"], self.w[p + "conv2.bias"], padding=1)

    def _quantize(self, emb: torch.Tensor) -> torch.Tensor:
        """RVQ over [T, hidden] -> codes [T, num_quantizers], nearest by Euclidean distance."""
        residual, codes = emb, []
        for i in range(self.num_quantizers):
            q = f"quantizer.quantizers.{i}."
            table = self.w[q + "codebook.embed"]
            x = F.linear(residual, self.w[q + "project_in.weight"], self.w[q + "project_in.bias"])
            dist = -(x.pow(2).sum(1, keepdim=True) - 2 * x @ table.t() + table.t().pow(2).sum(0, keepdim=True))
            idx = dist.max(dim=-1).indices
            residual = residual - F.linear(F.embedding(idx, table), self.w[q + "project_out.weight"],
                                           self.w[q + "project_out.bias"])
            codes.append(idx)
        return torch.stack(codes, dim=1)
