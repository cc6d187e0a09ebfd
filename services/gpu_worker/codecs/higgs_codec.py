"""Higgs Audio v2's codec decoder (bosonai/higgs-audio-v2-tokenizer, an X-codec):
codes -> 24 kHz sound, whole or streamed exactly.

transformers' `HiggsAudioV2TokenizerModel.decode` is the reference; this is its decoder
half in plain torch (transformers is not a runtime dependency), loading the same weights
(the codec folder's safetensors, weight norm folded where a file still carries it):

    codes [n, 8] -> RVQ (each codebook's embedding through its `project_out`, summed)
    -> fc2 (to the DAC's width) -> DAC decoder: conv k7, then per stride s a Snake, a
    transposed conv (kernel 2s, X-codec's output padding s % 2) and 3 residual units
    (Snake, conv k7 dilated 1 / 3 / 9, Snake, conv k1), a Snake and a conv k7 (no tanh)

Streaming (`HiggsStream`). The DAC's convs are symmetric ("same" padding), so a sample
depends on frames on both sides, up to `radius` frames away (from the config: 13 for the
real codec's strides). A stream sends a frame's samples once `radius` later frames have
arrived, decoding a window that reaches `radius` frames back: those samples are exactly
the whole decode's (same operations on the same inputs, up to float summation order), so
the chunks joined equal `decode` of all frames. `finish` decodes the rest against the
utterance's true end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

#: the decoder's tensors (the encoder's, the semantic model's, are never read)
DECODER_PARTS = ("quantizer.", "fc2.", "acoustic_decoder.")
#: the DAC residual units' dilations and kernel
DILATIONS = (1, 3, 9)
KERNEL = 7


def load_state(path: Path, parts: tuple[str, ...] = DECODER_PARTS) -> dict[str, torch.Tensor]:
    """The codec's tensors named `parts` from the folder's safetensors, weight norm folded
    (over the dimension its `g` keeps: 0 for the DAC's convs, 2 for HuBERT's positional conv)."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.startswith(parts):
                    state[key] = f.get_tensor(key).float()
    if not state:
        raise ValueError(f"{path}: no codec weights named {', '.join(p + '*' for p in parts)}")
    for g_name, v_name in ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
                           (".weight_g", ".weight_v")):
        for key in [k for k in state if k.endswith(g_name)]:
            base = key[: -len(g_name)]
            g, v = state.pop(key), state.pop(base + v_name)
            kept = [d for d in range(g.dim()) if g.shape[d] != 1]
            state[base + ".weight"] = torch._weight_norm(v, g, kept[0] if len(kept) == 1 else 0)
    return state


class HiggsCodec:
    """The decoder of an X-codec config dict (the codec folder's config.json)."""

    def __init__(self, path: str | Path, config: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
        acoustic = config.get("acoustic_model_config") or {}
        self.strides = [int(s) for s in acoustic.get("upsampling_ratios") or (8, 5, 4, 2, 3)]
        self.samples_per_frame = math.prod(int(s) for s in acoustic.get("downsampling_ratios") or self.strides)
        if math.prod(self.strides) != self.samples_per_frame:
            raise ValueError(f"the decoder's strides {self.strides} do not make the encoder's hop "
                             f"{self.samples_per_frame}")
        self.sample_rate = int(config.get("sample_rate", 24000))
        self.codebook_size = int(config.get("codebook_size", 1024))
        self.device = torch.device(device)
        state = load_state(Path(path))
        self.w = {k: v.to(self.device) for k, v in state.items()}
        self.num_quantizers = sum(1 for k in self.w if k.endswith(".codebook.embed"))
        self.radius = receptive_radius(self.strides)

    def _q(self, name: str) -> torch.Tensor:
        return self.w[name]

    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [n, K] -> the DAC's input [1, width, n] (RVQ decode, then fc2)."""
        out = torch.zeros((), device=self.device)
        for i in range(codes.shape[1]):
            p = f"quantizer.quantizers.{i}."
            emb = F.embedding(codes[:, i], self._q(p + "codebook.embed"))
            out = out + F.linear(emb, self._q(p + "project_out.weight"), self._q(p + "project_out.bias"))
        return F.linear(out, self._q("fc2.weight"), self._q("fc2.bias")).t().unsqueeze(0)

    def decode_window(self, codes: np.ndarray) -> torch.Tensor:
        """Frames [n, K] of codes -> float32 samples [n * samples_per_frame]."""
        with torch.inference_mode():
            c = torch.as_tensor(np.asarray(codes, dtype=np.int64), device=self.device)
            x = F.conv1d(self.latents(c), self._q("acoustic_decoder.conv1.weight"),
                         self._q("acoustic_decoder.conv1.bias"), padding=KERNEL // 2)
            for i, s in enumerate(self.strides):
                x = self._block(x, f"acoustic_decoder.block.{i}.", s)
            x = _snake(x, self._q("acoustic_decoder.snake1.alpha"))
            x = F.conv1d(x, self._q("acoustic_decoder.conv2.weight"), self._q("acoustic_decoder.conv2.bias"),
                         padding=KERNEL // 2)
            return x.reshape(-1).float()

    def _block(self, x: torch.Tensor, p: str, stride: int) -> torch.Tensor:
        x = F.conv_transpose1d(_snake(x, self._q(p + "snake1.alpha")), self._q(p + "conv_t1.weight"),
                               self._q(p + "conv_t1.bias"), stride=stride, padding=math.ceil(stride / 2),
                               output_padding=stride % 2)
        for j, d in enumerate(DILATIONS, start=1):
            r = f"{p}res_unit{j}."
            y = F.conv1d(_snake(x, self._q(r + "snake1.alpha")), self._q(r + "conv1.weight"),
                         self._q(r + "conv1.bias"), padding=(KERNEL - 1) * d // 2, dilation=d)
            y = F.conv1d(_snake(y, self._q(r + "snake2.alpha")), self._q(r + "conv2.weight"), self._q(r + "conv2.bias"))
            x = x + y
        return x

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """A whole utterance's frames [n, K] -> its samples (float32)."""
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        return self.decode_window(codes).cpu().numpy()

    def stream(self, min_chunk_frames: int = 1) -> HiggsStream:
        return HiggsStream(self, min_chunk_frames)


def _snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """DAC's Snake, as transformers' `Snake1d` computes it."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def receptive_radius(strides: list[int]) -> int:
    """Frames on each side a sample can depend on (rounded up, plus one): the first conv's
    3 frames, each transposed conv's 2 inputs and each block's residual units' 3 * (1 + 3 +
    9) samples at their rates, the last conv's 3 samples."""
    rate, frames = 1, float(KERNEL // 2)
    for s in strides:
        frames += 2 / rate
        rate *= s
        frames += (KERNEL // 2) * sum(DILATIONS) / rate
    frames += (KERNEL // 2) / rate
    return math.ceil(frames) + 1


class HiggsStream:
    """Codec frames in as they come, audio chunks out; the chunks joined (after `finish`)
    equal `codec.decode` of all the frames. After the first chunk, `push` waits until
    `min_chunk_frames` frames are final (each decode re-reads `radius` frames each side)."""

    def __init__(self, codec: HiggsCodec, min_chunk_frames: int = 1) -> None:
        self.codec = codec
        self.min_chunk = max(1, min_chunk_frames)
        self.held = np.zeros((0, codec.num_quantizers), dtype=np.int64)
        self.held_from = 0  # the utterance frame of held[0]
        self.received = 0
        self.emitted = 0  # frames whose samples are sent
        self.finished = False

    def push(self, frames: np.ndarray) -> np.ndarray:
        """Add frames [n, K]; the float32 samples now final (possibly none)."""
        frames = np.asarray(frames, dtype=np.int64).reshape(-1, self.codec.num_quantizers)
        self.held = np.concatenate([self.held, frames])
        self.received += len(frames)
        ready = self.received - self.codec.radius
        if ready <= self.emitted or (self.emitted and ready - self.emitted < self.min_chunk):
            return np.zeros(0, dtype=np.float32)
        return self._emit(ready)

    def finish(self) -> np.ndarray:
        """The remaining samples, decoded against the utterance's end."""
        if self.finished:
            raise ValueError("finish called twice")
        self.finished = True
        return self._emit(self.received) if self.received > self.emitted else np.zeros(0, dtype=np.float32)

    def _emit(self, end: int) -> np.ndarray:
        """Samples of frames [emitted, end), from a window reaching `radius` frames back."""
        start = max(0, self.emitted - self.codec.radius)
        audio = self.codec.decode_window(self.held[start - self.held_from:])
        n = self.codec.samples_per_frame
        chunk = audio[(self.emitted - start) * n: (end - start) * n].cpu().numpy()
        self.emitted = end
        keep = max(0, end - self.codec.radius)
        self.held = self.held[keep - self.held_from:]
        self.held_from = keep
        return chunk
