"""Qwen3-TTS' speaker encoder (Base checkpoints' `speaker_encoder.*`, the `qwen-tts`
package's `Qwen3TTSSpeakerEncoder`) and its mel front end: a reference clip at 24 kHz ->
one x-vector, the talker's row that stands for the cloned voice.

- `mel_spectrogram`: the package's (`extract_speaker_embedding`: n_fft 1024, 128 mels,
  hop 256, window 1024, 0..12 kHz): reflect padding of (n_fft - hop) / 2 each side, an
  uncentred STFT with a periodic Hann window, magnitude sqrt(re^2 + im^2 + 1e-9), librosa's
  Slaney mel filters (`slaney_mel_filters`, librosa's `filters.mel` step for step in
  numpy, so no librosa at serve time), log of max(., 1e-5);
- `SpeakerEncoder`: ECAPA-TDNN (a TDNN, SE-Res2Net blocks, multi-layer aggregation,
  attentive statistics pooling, a 1x1 conv to `enc_dim`); every conv is "same" padded
  with reflection, as the package's `nn.Conv1d(padding="same", padding_mode="reflect")`.
  Parameter names are the checkpoint's under `speaker_encoder.`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "speaker_encoder."
#: the package's `extract_speaker_embedding` front end (hard-coded there, not in the config)
SAMPLE_RATE, N_FFT, N_MELS, HOP, WINDOW, FMIN, FMAX = 24000, 1024, 128, 256, 1024, 0.0, 12000.0
#: the package's defaults (`Qwen3TTSSpeakerEncoderConfig`)
DEFAULTS: dict[str, Any] = {"mel_dim": 128, "enc_dim": 1024, "enc_channels": [512, 512, 512, 512, 1536],
                            "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
                            "enc_attention_channels": 128, "enc_res2net_scale": 8, "enc_se_channels": 128,
                            "sample_rate": 24000}


# -- the mel front end -------------------------------------------------------------------


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """librosa's Slaney `hz_to_mel`."""
    mels = freq / (200.0 / 3)
    log_t = freq >= 1000.0
    mels[log_t] = 15.0 + np.log(freq[log_t] / 1000.0) / (np.log(6.4) / 27.0)
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    """librosa's Slaney `mel_to_hz`."""
    freqs = (200.0 / 3) * mels
    log_t = mels >= 15.0
    freqs[log_t] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[log_t] - 15.0))
    return freqs


def slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """librosa's `filters.mel(sr, n_fft, n_mels, fmin, fmax)` (Slaney scale and norm,
    float32 [n_mels, 1 + n_fft // 2]), its float64 steps and float32 roundings kept."""
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(np.asarray([fmin], dtype=np.float64))[0],
                                   _hz_to_mel(np.asarray([fmax], dtype=np.float64))[0], n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fftfreqs)
    for i in range(n_mels):
        weights[i] = np.maximum(0, np.minimum(-ramps[i] / fdiff[i], ramps[i + 2] / fdiff[i + 1]))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, np.newaxis]
    return weights


_FILTERS: dict[str, torch.Tensor] = {}


def mel_spectrogram(wave: torch.Tensor) -> torch.Tensor:
    """Samples [B, n] at 24 kHz -> log mel [B, frames, 128] (the package's
    `mel_spectrogram(...).transpose(1, 2)` with `extract_speaker_embedding`'s settings)."""
    key = str(wave.device)
    if key not in _FILTERS:
        _FILTERS[key] = torch.from_numpy(slaney_mel_filters(SAMPLE_RATE, N_FFT, N_MELS, FMIN, FMAX)).to(wave.device)
    pad = (N_FFT - HOP) // 2
    y = F.pad(wave.float().unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(y, N_FFT, hop_length=HOP, win_length=WINDOW, window=torch.hann_window(WINDOW, device=y.device),
                      center=False, normalized=False, onesided=True, return_complex=True)
    spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(torch.matmul(_FILTERS[key], spec), min=1e-5)).transpose(1, 2)


# -- ECAPA-TDNN -----------------------------------------------------------------------


def _conv(cin: int, cout: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class _TDNN(nn.Module):
    """Conv then ReLU (the package's `TimeDelayNetBlock`)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class _Res2Net(nn.Module):
    """`scale` channel groups: the first passed through, each next one a TDNN of itself
    plus the previous group's output."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(_TDNN(channels // scale, channels // scale, kernel, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            outs.append(part if i == 0 else self.blocks[i - 1](part if i == 1 else part + outs[-1]))
        return torch.cat(outs, dim=1)


class _SqueezeExcite(nn.Module):
    def __init__(self, cin: int, se: int, cout: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(cin, se), _conv(se, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))


class _SERes2Net(nn.Module):
    """TDNN, Res2Net, TDNN, squeeze-excitation, plus the input."""

    def __init__(self, cin: int, cout: int, scale: int, se: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = _TDNN(cin, cout, 1, 1)
        self.res2net_block = _Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = _TDNN(cout, cout, 1, 1)
        self.se_block = _SqueezeExcite(cout, se, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _stats(x: torch.Tensor, weights: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (weights * x).sum(2)
    return mean, torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(eps))


class _AttentivePooling(nn.Module):
    """Attentive statistics pooling over a whole clip (no padding: the package's mask is all
    ones): [B, C, T] -> the attention-weighted mean and std [B, 2C, 1]."""

    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = _TDNN(channels * 3, attention, 1, 1)
        self.conv = _conv(attention, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        uniform = torch.full((x.shape[0], 1, t), 1.0 / t, dtype=x.dtype, device=x.device)
        mean, std = _stats(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], dim=1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _stats(x, attention)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """Log mel [B, frames, mel_dim] -> x-vectors [B, enc_dim]."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        c = {**DEFAULTS, **(config or {})}
        ch: Sequence[int] = c["enc_channels"]
        ks: Sequence[int] = c["enc_kernel_sizes"]
        dil: Sequence[int] = c["enc_dilations"]
        if not len(ch) == len(ks) == len(dil):
            raise ValueError("the speaker encoder's enc_channels, enc_kernel_sizes and enc_dilations differ in length")
        if int(c["mel_dim"]) != N_MELS:
            raise ValueError(f"the speaker encoder reads {N_MELS} mels (the package's front end); mel_dim is "
                             f"{c['mel_dim']}")
        self.sample_rate = int(c["sample_rate"])
        self.blocks = nn.ModuleList([_TDNN(int(c["mel_dim"]), ch[0], ks[0], dil[0])])
        self.blocks.extend(_SERes2Net(ch[i - 1], ch[i], int(c["enc_res2net_scale"]), int(c["enc_se_channels"]),
                                      ks[i], dil[i]) for i in range(1, len(ch) - 1))
        self.mfa = _TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = _AttentivePooling(ch[-1], int(c["enc_attention_channels"]))
        self.fc = _conv(ch[-1] * 2, int(c["enc_dim"]))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """The checkpoint's `speaker_encoder.*` tensors."""
        own = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)  # built on the meta device
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match Qwen3-TTS' speaker encoder: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    @torch.inference_mode()
    def embed(self, wave: np.ndarray) -> torch.Tensor:
        """One clip's samples at the encoder's rate (24 kHz) -> its x-vector [enc_dim]
        (the package's `extract_speaker_embedding`)."""
        if self.sample_rate != SAMPLE_RATE:
            raise ValueError(f"the speaker encoder's front end is 24 kHz; its config says {self.sample_rate}")
        param = next(self.parameters())
        mels = mel_spectrogram(torch.from_numpy(np.asarray(wave, dtype=np.float32))[None].to(param.device))
        return self(mels.to(param.dtype))[0]
