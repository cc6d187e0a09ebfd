"""S3Gen's vocoder (Chatterbox's `HiFTGenerator`, from CosyVoice): mel [80, T] -> 24 kHz.

The package's `mel2wav` in plain torch, its parameter names (s3gen.safetensors' `mel2wav.*`,
weight norm kept as torch's parametrization, as the package builds it):
- F0 from the mel (`ConvRNNF0Predictor`: 5 weight-normed convs with ELU, a linear, |.|);
- the neural source filter (`SourceModuleHnNSF`): F0 upsampled by 480 (nearest), the
  fundamental and 8 harmonics as sines with random phases (harmonic 0's phase is 0), noise
  where unvoiced (F0 <= 10 Hz), merged by a linear and tanh;
- the generator: conv_pre, per upsampling (8, 5, 3) a leaky ReLU and a transposed conv, the
  source's STFT brought to that rate (`source_downs`, `source_resblocks`) added, the mean of
  3 residual blocks (Snake activations, dilations 1 / 3 / 5); then conv_post to a magnitude
  (exp) and phase (sin) of a 16-point STFT, inverted with hop 4, clamped to +-0.99.

The noise is drawn in the package's order from a generator the caller passes (the package
draws from torch's global one): the phases (uniform in [-pi, pi)), the sines' noise, and the
module's extra noise draw (unused, drawn so later draws line up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

#: S3Token2Wav's arguments to HiFTGenerator, then HiFTGenerator's own defaults
HIFT = {"in_channels": 80, "base_channels": 512, "nb_harmonics": 8, "sampling_rate": 24000, "nsf_alpha": 0.1,
        "nsf_sigma": 0.003, "nsf_voiced_threshold": 10.0, "upsample_rates": [8, 5, 3],
        "upsample_kernel_sizes": [16, 11, 7], "istft_params": {"n_fft": 16, "hop_len": 4},
        "resblock_kernel_sizes": [3, 7, 11], "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "source_resblock_kernel_sizes": [7, 7, 11],
        "source_resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "lrelu_slope": 0.1,
        "audio_limit": 0.99}
F0_PREDICTOR = {"num_class": 1, "in_channels": 80, "cond_channels": 512}


class Snake(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


def _pad(kernel: int, dilation: int = 1) -> int:
    return int((kernel * dilation - dilation) / 2)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: list[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(weight_norm(nn.Conv1d(channels, channels, kernel, 1, dilation=d,
                                                          padding=_pad(kernel, d))) for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(nn.Conv1d(channels, channels, kernel, 1, dilation=1,
                                                          padding=_pad(kernel))) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = c2(a2(c1(a1(x)))) + x
        return x


class F0Predictor(nn.Module):
    """`ConvRNNF0Predictor`: mel [B, 80, T] -> F0 [B, T] (Hz)."""

    def __init__(self, num_class: int, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)),
                       nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.abs(self.classifier(self.condnet(x).transpose(1, 2)).squeeze(-1))


class SourceModule(nn.Module):
    """`SourceModuleHnNSF` with its `SineGen`: F0 [B, L, 1] at the sample rate -> source [B, L, 1]."""

    def __init__(self, rate: int, harmonics: int, amp: float, noise_std: float, voiced: float) -> None:
        super().__init__()
        self.rate, self.harmonics, self.amp, self.noise_std, self.voiced = rate, harmonics, amp, noise_std, voiced
        self.l_linear = nn.Linear(harmonics + 1, 1)

    def forward(self, f0: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        f0 = f0.transpose(1, 2)  # [B, 1, L]
        b, n = f0.shape[0], self.harmonics + 1
        freqs = torch.zeros((b, n, f0.shape[-1]), device=f0.device)
        for i in range(n):
            freqs[:, i: i + 1, :] = f0 * (i + 1) / self.rate
        theta = 2 * math.pi * (torch.cumsum(freqs, dim=-1) % 1)
        low, high = torch.tensor(-math.pi), torch.tensor(math.pi)  # torch.distributions.Uniform's arithmetic
        phase = (low + torch.rand((b, n, 1), generator=gen) * (high - low)).to(f0.device)
        phase[:, 0, :] = 0
        sines = self.amp * torch.sin(theta + phase)
        uv = (f0 > self.voiced).to(torch.float32)
        noise_amp = uv * self.noise_std + (1 - uv) * self.amp / 3
        noise = noise_amp * torch.randn(sines.shape, generator=gen).to(sines.device)
        sines = (sines * uv + noise).transpose(1, 2)
        torch.randn(uv.transpose(1, 2).shape, generator=gen)  # the package's unused noise draw
        return torch.tanh(self.l_linear(sines))


class HiFT(nn.Module):
    """`HiFTGenerator` (the package's `mel2wav`); `config` overrides its arguments (the
    folder's config.json "s3gen" section: "HiFTGenerator", "ConvRNNF0Predictor")."""

    window: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: Mapping[str, Any] | None = None, f0: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        c = {**HIFT, **(config or {})}
        self.c = c
        base, n_fft = int(c["base_channels"]), int(c["istft_params"]["n_fft"])
        self.n_fft, self.hop = n_fft, int(c["istft_params"]["hop_len"])
        ups = list(c["upsample_rates"])
        self.upsample = math.prod(ups) * self.hop
        self.m_source = SourceModule(int(c["sampling_rate"]), int(c["nb_harmonics"]), float(c["nsf_alpha"]),
                                     float(c["nsf_sigma"]), float(c["nsf_voiced_threshold"]))
        self.conv_pre = weight_norm(nn.Conv1d(int(c["in_channels"]), base, 7, 1, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(base // 2**i, base // 2**(i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(ups, c["upsample_kernel_sizes"])))
        downs = [1, *ups[::-1][:-1]]
        cum = [math.prod(downs[: i + 1]) for i in range(len(downs))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(cum, c["source_resblock_kernel_sizes"], c["source_resblock_dilation_sizes"])):
            ch = base // 2 ** (i + 1)
            self.source_downs.append(nn.Conv1d(n_fft + 2, ch, 1, 1) if u == 1
                                     else nn.Conv1d(n_fft + 2, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.kernels = len(c["resblock_kernel_sizes"])
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d) for i in range(len(ups))
            for k, d in zip(c["resblock_kernel_sizes"], c["resblock_dilation_sizes"]))
        self.conv_post = weight_norm(nn.Conv1d(base // 2 ** len(ups), n_fft + 2, 7, 1, padding=3))
        self.f0_predictor = F0Predictor(**{**F0_PREDICTOR, **(f0 or {})})
        self.register_buffer("window", torch.hann_window(n_fft, periodic=True), persistent=False)

    def fold_weight_norm(self) -> None:
        """Each weight-normed conv's weight computed once, after its weights are loaded:
        torch's parametrization recomputes `g * v / |v|` at every call (82 convs, a
        norm, a division and a product each, per utterance) and the weights never change
        while serving. The same function on the same tensors, so the same weights."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def forward(self, mel: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """Mel [B, 80, T] -> samples [B, T * 480]."""
        f0 = self.f0_predictor(mel)
        s = F.interpolate(f0[:, None], scale_factor=float(self.upsample), mode="nearest").transpose(1, 2)
        s = self.m_source(s, gen).transpose(1, 2)
        return self.decode(mel, s)

    def decode(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        spec = torch.view_as_real(torch.stft(s.squeeze(1), self.n_fft, self.hop, self.n_fft, window=self.window,
                                             return_complex=True))
        s_stft = torch.cat([spec[..., 0], spec[..., 1]], dim=1)
        x = self.conv_pre(x)
        slope = float(self.c["lrelu_slope"])
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * self.kernels](x)
            for j in range(1, self.kernels):
                xs += self.resblocks[i * self.kernels + j](x)
            x = xs / self.kernels
        x = self.conv_post(F.leaky_relu(x))
        half = self.n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :half, :]), max=1e2)
        phase = torch.sin(x[:, half:, :])
        wav = torch.istft(torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase)), self.n_fft,
                          self.hop, self.n_fft, window=self.window)
        limit = float(self.c["audio_limit"])
        return torch.clamp(wav, -limit, limit)
