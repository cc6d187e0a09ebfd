"""A Chatterbox voice from a reference clip: the package's `prepare_conditionals` without the
package (numpy / torch only; librosa's mel filters as numpy, modeling/speech/qwen3_tts_speaker.py).

From 24 kHz samples (the data worker decoded the clip at 24 kHz):
- the clip at 16 kHz: torchaudio's windowed-sinc resampling (the package resamples with
  torchaudio in `embed_ref` and with librosa in `prepare_conditionals`; mstar uses the one
  kernel for both, and the tests hand the reference the same one for librosa's);
- T3's half: the voice encoder's speaker embedding (its mel of the silence-trimmed 16 kHz
  clip, librosa's `stft` / `effects.trim` step for step) and the S3 tokens of the first
  6 s at 16 kHz (150 at most);
- S3Gen's half (`embed_ref`, the first 10 s): the S3 tokens of the clip at 16 kHz, its
  24 kHz mel (Matcha's `mel_spectrogram`) and CAMPPlus' x-vector of its Kaldi fbank; the
  tokens cut to half the mel's frames where they disagree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from services.gpu_worker.codecs.higgs_encoder import resample
from services.gpu_worker.modeling.speech import chatterbox_encoders as enc
from services.gpu_worker.modeling.speech.qwen3_tts_speaker import slaney_mel_filters

S3GEN_SR, S3_SR = 24000, 16000
ENC_COND_LEN, DEC_COND_LEN = 6 * S3_SR, 10 * S3GEN_SR
PROMPT_TOKENS = 150  # T3's speech_cond_prompt_len


@dataclass
class ClipVoice:
    """What `prepare_conditionals` makes: T3's (`speaker_emb` [1, 256], `t3_tokens` [1, n])
    and S3Gen's (`prompt_token` [1, m], `prompt_feat` [1, 2m, 80], `xvector` [1, 192])."""

    speaker_emb: torch.Tensor
    t3_tokens: torch.Tensor
    prompt_token: torch.Tensor
    prompt_feat: torch.Tensor
    xvector: torch.Tensor


# -- features -----------------------------------------------------------------------------


def trim(wav: np.ndarray, top_db: float = 20, frame: int = 2048, hop: int = 512) -> np.ndarray:
    """librosa's `effects.trim` (RMS of centred zero-padded frames, dB below the loudest)."""
    padded = np.pad(wav, frame // 2)
    frames = np.lib.stride_tricks.sliding_window_view(padded, frame)[::hop]
    rms = np.sqrt(np.mean(np.abs(frames) ** 2, axis=-1, dtype=np.float32))
    power = np.maximum(1e-10, rms.astype(np.float64) ** 2)
    db = 10 * np.log10(power) - 10 * np.log10(max(1e-10, float(rms.max()) ** 2))
    loud = np.flatnonzero(db > -top_db)
    if loud.size == 0:
        return wav[:0]
    return wav[loud[0] * hop: min(wav.shape[-1], (loud[-1] + 1) * hop)]


def ve_mel(wav: np.ndarray, n_fft: int = 400, hop: int = 160) -> torch.Tensor:
    """The voice encoder's mel [T, 40]: librosa's centred reflect-padded STFT (periodic
    Hann), power, Slaney mel to 8 kHz; no log."""
    padded = np.pad(wav.astype(np.float32), n_fft // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    spec = np.abs(np.fft.rfft(frames * window, axis=-1).astype(np.complex64)) ** 2
    mel = slaney_mel_filters(S3_SR, n_fft, 40, 0.0, 8000.0) @ spec.T.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(mel.T, dtype=np.float32))


def kaldi_fbank(wav: torch.Tensor, bins: int = 80, rate: int = S3_SR) -> torch.Tensor:
    """Kaldi's compute-fbank-feats at torchaudio's `fbank` defaults: 25 ms frames every
    10 ms (whole frames only), each frame's mean removed, pre-emphasis 0.97, Povey window,
    FFT of 512, power, mel triangles 20 Hz..Nyquist on 1127 ln(1 + f/700), log (floor eps)."""
    size, shift = rate * 25 // 1000, rate * 10 // 1000
    fft = 1 << (size - 1).bit_length()
    frames = wav.unfold(0, size, shift)
    frames = frames - frames.mean(dim=1, keepdim=True)
    frames = frames - 0.97 * F.pad(frames.unsqueeze(0), (1, 0), mode="replicate")[0, :, :-1]
    frames = frames * torch.hann_window(size, periodic=False, dtype=wav.dtype).pow(0.85)
    power = torch.fft.rfft(F.pad(frames, (0, fft - size))).abs().pow(2.0)
    low, high = (1127.0 * math.log(1.0 + f / 700.0) for f in (20.0, rate / 2))
    step = (high - low) / (bins + 1)
    b = torch.arange(bins).unsqueeze(1)
    left, center, right = low + b * step, low + (b + 1.0) * step, low + (b + 2.0) * step
    fft_mel = 1127.0 * (1.0 + (rate / fft) * torch.arange(fft // 2) / 700.0).log()
    up, down = (fft_mel - left) / (center - left), (right - fft_mel) / (right - center)
    banks = F.pad(torch.clamp(torch.min(up, down), min=0.0), (0, 1)).to(wav.dtype)
    return torch.clamp(power @ banks.T, min=torch.finfo(torch.float).eps).log()


def s3_log_mel(wav: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """The S3 tokenizer's log-mel [128, T] (Whisper's: centred STFT of 400, hop 160, the
    last frame dropped, log10 floored 8 below the top, scaled)."""
    stft = torch.stft(wav, 400, 160, window=torch.hann_window(400), return_complex=True)
    mel = filters @ stft[..., :-1].abs() ** 2
    log = torch.clamp(mel, min=1e-10).log10()
    return (torch.maximum(log, log.max() - 8.0) + 4.0) / 4.0


def s3gen_mel(wav: torch.Tensor, filters: torch.Tensor, n_fft: int = 1920, hop: int = 480) -> torch.Tensor:
    """S3Gen's prompt mel [T, 80] of 24 kHz samples (Matcha's `mel_spectrogram`)."""
    pad = (n_fft - hop) // 2
    y = F.pad(wav[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(y, n_fft, hop_length=hop, win_length=n_fft, window=torch.hann_window(n_fft), center=False,
                      return_complex=True)
    spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(filters @ spec, min=1e-5))[0].t()


# -- the whole ----------------------------------------------------------------------------


class ChatterboxClip:
    """The folder's clip encoders (ve.safetensors; s3gen.safetensors' `tokenizer.*` and
    `speaker_encoder.*`), on the CPU: a clip is encoded once, at its request's admission."""

    def __init__(self, folder: Path) -> None:
        cfg_path = folder / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        with safe_open(str(folder / "s3gen.safetensors"), framework="pt") as f:  # only the two encoders' tensors
            names = list(f.keys())
            self.tokenizer = {k[len("tokenizer."):]: f.get_tensor(k).float() for k in names
                              if k.startswith("tokenizer.")}
            self.xvector = {k[len("speaker_encoder."):]: f.get_tensor(k).float() for k in names
                            if k.startswith("speaker_encoder.")}
        ve = {k: v.float() for k, v in load_file(str(folder / "ve.safetensors")).items()}
        self.ve, self.lstm = ve, enc.make_lstm(ve)
        state = self.tokenizer["encoder.conv2.weight"].shape[0]
        self.heads = enc.heads_of(dict(cfg.get("s3tokenizer") or {}), state)
        n_mels = self.tokenizer["encoder.conv1.weight"].shape[1]
        self.s3_filters = torch.from_numpy(slaney_mel_filters(S3_SR, 400, n_mels, 0.0, S3_SR / 2))
        self.gen_filters = torch.from_numpy(slaney_mel_filters(S3GEN_SR, 1920, 80, 0.0, 8000.0))

    def tokens(self, wav16: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
        mel = s3_log_mel(wav16, self.s3_filters)
        if max_len is not None:
            mel = mel[..., : max_len * 4]
        return enc.s3_tokens(self.tokenizer, mel, self.heads)

    @torch.inference_mode()
    def encode(self, wav24: np.ndarray) -> ClipVoice:
        """The conditionals of a clip's 24 kHz float32 samples."""
        full = torch.from_numpy(np.ascontiguousarray(wav24, dtype=np.float32))
        ref16 = resample(full, S3GEN_SR, S3_SR)
        ref24 = full[:DEC_COND_LEN]
        gen16 = resample(ref24, S3GEN_SR, S3_SR)
        prompt_feat = s3gen_mel(ref24, self.gen_filters)[None]
        fbank = kaldi_fbank(gen16)
        xvector = enc.campplus(self.xvector, fbank - fbank.mean(dim=0, keepdim=True))
        prompt_token = self.tokens(gen16)
        if prompt_feat.shape[1] != 2 * prompt_token.shape[1]:
            prompt_token = prompt_token[:, : prompt_feat.shape[1] // 2]
        t3_tokens = self.tokens(ref16[:ENC_COND_LEN], PROMPT_TOKENS)
        speaker = enc.voice_encoder(self.lstm, self.ve, ve_mel(trim(ref16.numpy())))
        return ClipVoice(speaker, t3_tokens, prompt_token, prompt_feat, xvector)
