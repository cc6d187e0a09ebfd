"""Mimi's encoder (kyutai's codec, CSM's): 24 kHz sound -> codes, for CSM's context turns.

A CSM request may carry earlier turns with their audio (voice continuation); the model
reads that audio as frames of Mimi codes, which transformers' `CsmForConditionalGeneration`
makes with `MimiModel.encode` (tests/unit/test_mimi_codec.py is the reference check: the
codes are equal). This is that encoder in plain torch (transformers is not a runtime
dependency), on the same weights as the decoder (`codec_model.*` of a CSM checkpoint):

    samples [n] -> SEANet encoder (causal convs: x4 x5 x6 x8 strides) -> transformer
    (causal, sliding window) -> downsample (stride 2, replicate padding: 25 -> 12.5 Hz)
    -> split RVQ (semantic and acoustic halves, each a 1x1 input projection, then each
    codebook's nearest centroid of the residual) -> codes [frames, K]

A clip is encoded whole, once per request at admission (the gpu worker's CSM runner), so
nothing is streamed: every conv pads on the left by its kernel less its stride and on the
right to a whole number of strides, as transformers' non-streaming `MimiConv1d` does; a
clip of n samples makes ceil(n / 1920) frames at Mimi's rates (`shared.specs.csm.encoded_frames`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker.codecs.mimi_codec import (
    MimiSettings,
    _load,
    attend_out,
    codebook_tables,
    project_qkv,
    rope_inv_freq,
    rope_tables,
    transformer_layer,
)

#: the names of the encoder's tensors (the quantizer's centroids are the decoder's too)
ENCODER_PARTS = ("encoder.", "encoder_transformer.", "downsample.", "quantizer.")


def causal_conv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: int = 1,
                dilation: int = 1, mode: str = "constant") -> torch.Tensor:
    """transformers' causal `MimiConv1d` on a whole clip: padded left by the kernel's span
    less the stride, right by what makes the last stride whole (`mode`: zeros, or the edge
    value for the downsample)."""
    span = (w.shape[-1] - 1) * dilation + 1
    total = span - stride
    length = x.shape[-1]
    frames = math.ceil((length - span + total) / stride + 1) - 1
    extra = frames * stride + span - total - length
    return F.conv1d(F.pad(x, (total, extra), mode=mode), w, bias, stride=stride, dilation=dilation)


class MimiEncoder:
    """The encoder's weights; `encode` is one clip at a time (as transformers' CSM calls it)."""

    def __init__(self, folder: str | Path, config: Mapping[str, Any], device: torch.device | str = "cpu",
                 weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """`weights`: the encoder's tensors by Mimi's own names where the caller read them
        (Qwen3-TTS' codec keeps them under another prefix); else CSM's `codec_model.*`."""
        self.s = MimiSettings(config)
        self.device = torch.device(device)
        w = dict(weights) if weights is not None else _load(Path(folder), ENCODER_PARTS)
        if "encoder.layers.0.conv.weight" not in w:
            raise ValueError(f"{folder}: the codec has no encoder weights (encoder.layers.*)")
        self.w = {k: v.to(self.device) for k, v in w.items()}
        self.tables = codebook_tables(self.w, self.s)
        self.inv_freq = rope_inv_freq(self.s).to(self.device)
        self.seanet = self._seanet_plan()
        #: the keys a query sees; Qwen3-TTS' package runs its encoder with none dropped
        self.window = self.s.window

    def _seanet_plan(self) -> list[tuple]:
        """The SEANet encoder's layers in order: (kind, weight name, dilation or stride)."""
        s = self.s
        plan: list[tuple] = [("conv", "encoder.layers.0.conv", 1)]
        i = 1
        for ratio in reversed(s.ratios):
            for j in range(s.res_layers):
                plan.append(("res", f"encoder.layers.{i}.block", s.growth ** j))
                i += 1
            plan += [("elu",), ("conv", f"encoder.layers.{i + 1}.conv", ratio)]
            i += 2
        plan += [("elu",), ("conv", f"encoder.layers.{i + 1}.conv", 1)]
        return plan

    def encode(self, samples: np.ndarray) -> np.ndarray:
        """Mono float32 samples at the codec's rate -> codes [frames, num_quantizers]."""
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)).view(1, 1, -1).to(self.device)
            for step in self.seanet:
                x = self._seanet_step(step, x)
            x = self._transformer(x.transpose(1, 2)).transpose(1, 2)
            x = causal_conv(x, self.w["downsample.conv.weight"], None, stride=self.s.stride, mode="replicate")
            return self._quantize(x[0].t()).cpu().numpy()

    def _seanet_step(self, step: tuple, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if step[0] == "elu":
            return F.elu(x)
        if step[0] == "conv":
            return causal_conv(x, w[step[1] + ".weight"], w.get(step[1] + ".bias"), stride=step[2])
        name = step[1]  # a residual block: ELU, conv (dilated), ELU, 1x1 conv, plus its input
        h = causal_conv(F.elu(x), w[f"{name}.1.conv.weight"], w.get(f"{name}.1.conv.bias"), dilation=step[2])
        return x + causal_conv(F.elu(h), w[f"{name}.3.conv.weight"], w.get(f"{name}.3.conv.bias"))

    def _transformer(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T, hidden] through the encoder transformer: positions 0..T-1, each query
        seeing the keys of the last `window` positions."""
        s, w = self.s, self.w
        pos = torch.arange(x.shape[1], device=x.device)
        cos, sin = rope_tables(self.inv_freq, pos)
        mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - self.window)

        def attend(p: str, h: torch.Tensor) -> torch.Tensor:
            return attend_out(*project_qkv(h, w, s, p, cos, sin), mask, w, s, p)

        for i in range(s.layers):
            p = f"encoder_transformer.layers.{i}."
            x = transformer_layer(x, w, s, p, functools.partial(attend, p + "self_attn."))
        return x

    def _quantize(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [T, hidden] -> codes [T, K]: per half, its input projection, then each
        codebook takes the nearest centroid (`torch.cdist`'s argmin, as transformers) of what
        the half's earlier codebooks left."""
        sem = self.s.semantic
        codes = []
        for kind, tables in (("semantic", self.tables[:sem]), ("acoustic", self.tables[sem:])):
            proj = self.w.get(f"quantizer.{kind}_residual_vector_quantizer.input_proj.weight")
            # a 1x1 conv as transformers' (not a linear: the same sums, so the same argmins)
            residual = F.conv1d(latents.t()[None], proj)[0].t() if proj is not None else latents
            for table in tables:
                idx = torch.cdist(residual[None].float(), table[None].float(), p=2)[0].argmin(dim=-1)
                residual = residual - F.embedding(idx, table)
                codes.append(idx)
        return torch.stack(codes, dim=1)

