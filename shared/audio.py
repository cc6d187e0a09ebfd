"""Audio in: decode WAV/FLAC bytes to mono float32 and compute Whisper's log-mel features.

The Whisper spec's `process_prompt` (run by the data worker, like every request's) turns
a client's audio bytes into the model's `input_features` here, so the tensor that
travels in `NewRequest` is the small feature matrix (n_mels x 3000 floats
for a 30 s window), not the waveform. The features are computed with numpy as
transformers' `WhisperFeatureExtractor` does (same mel filter bank, same centred STFT with
a periodic Hann window, same clamping), so a checkpoint sees the inputs it was trained on:
within 3e-5 of the extractor (float64 here; its torch path computes in float32).

Every problem with the client's audio raises `ValueError` with a message that is safe to
show the client (the api makes it a 400); nothing else here raises on bad input.

No torch: the data worker, which runs the Whisper spec's `process_prompt`, never loads
it (~200 MB and its start-up).

Choices (DESIGN.md says to write them down):
- a rate other than the feature extractor's is resampled (band-limited windowed-sinc
  interpolation, torchaudio's `sinc_interp_hann` kernel), not refused;
- several channels are averaged to mono;
- audio longer than the window (`chunk_length`, 30 s) is refused, not silently cut:
  long-form transcription is not implemented;
- only WAV and FLAC containers are accepted.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.deferred import deferred
from shared.pages import ceil_div

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: containers libsndfile reports for the formats we accept
ACCEPTED_FORMATS = frozenset({"WAV", "WAVEX", "RF64", "FLAC"})
MIN_SAMPLING_RATE, MAX_SAMPLING_RATE = 1_000, 384_000


@dataclass(frozen=True)
class FeatureConfig:
    """The feature extractor's settings (preprocessor_config.json of a Whisper folder)."""

    feature_size: int = 80
    sampling_rate: int = 16_000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400
    padding_value: float = 0.0

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        return self.n_samples // self.hop_length

    @classmethod
    def from_dict(cls, d: dict) -> FeatureConfig:
        if d.get("dither", 0.0):
            raise ValueError("feature extractor dither is not supported (it makes features random)")
        names = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value")
        return cls(**{k: type(getattr(cls, k))(d[k]) for k in names if d.get(k) is not None})

    @classmethod
    def from_folder(cls, path: Path, feature_size: int | None = None) -> FeatureConfig:
        """preprocessor_config.json if the folder has one, else the defaults (with the
        model's `num_mel_bins` as `feature_size`)."""
        f = Path(path) / "preprocessor_config.json"
        d = json.loads(f.read_text()) if f.exists() else {}
        if feature_size is not None and "feature_size" not in d:
            d["feature_size"] = feature_size
        return cls.from_dict(d)


# -- decoding ------------------------------------------------------------------------------


def decode_audio(data: bytes, sampling_rate: int, max_seconds: float | None = None,
                 limit: str = "this model transcribes", formats: frozenset[str] = ACCEPTED_FORMATS) -> np.ndarray:
    """WAV/FLAC bytes (or another of `formats`, libsndfile's names) -> mono float32
    samples at `sampling_rate`.

    The header is read first, so an over-long file is refused before it is decoded (the
    message says "`limit` at most N s per request")."""
    import soundfile as sf  # lazy: only the data worker decodes audio

    if not isinstance(data, bytes | bytearray | memoryview) or len(data) == 0:
        raise ValueError("audio is empty")
    try:
        f = sf.SoundFile(io.BytesIO(bytes(data)))
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise ValueError(f"audio could not be decoded; send {_named(formats)}") from exc
    with f:
        if f.format not in formats:
            raise ValueError(f"audio format {f.format} is not supported; send {_named(formats)}")
        rate = int(f.samplerate)
        if not MIN_SAMPLING_RATE <= rate <= MAX_SAMPLING_RATE:
            raise ValueError(f"audio sampling rate {rate} Hz is outside [{MIN_SAMPLING_RATE}, {MAX_SAMPLING_RATE}] Hz")
        if f.frames <= 0:
            raise ValueError("audio has no samples")
        seconds = f.frames / rate
        if max_seconds is not None and seconds > max_seconds:
            raise ValueError(f"audio is {seconds:.2f} s long; "
                             f"{limit} at most {max_seconds:g} s per request")
        try:
            samples = f.read(dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise ValueError("audio could not be decoded; the file is damaged") from exc
    if samples.shape[0] == 0:
        raise ValueError("audio has no samples")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if not np.isfinite(mono).all():
        raise ValueError("audio contains non-finite samples (NaN or infinity)")
    if rate != sampling_rate:
        mono = resample(mono, rate, sampling_rate)
    return np.ascontiguousarray(mono, dtype=np.float32)


def _named(formats: frozenset[str]) -> str:
    """The accepted containers as a refusal names them ("a WAV or FLAC file")."""
    order = ("WAV", "FLAC", "MP3", "OGG")  # the historical "a WAV or FLAC file" first
    named = {{"WAVEX": "WAV", "RF64": "WAV"}.get(f, f) for f in formats}
    shown = [f for f in order if f in named] + sorted(named - set(order))
    return "a " + (" or ".join(shown) if len(shown) < 3 else ", ".join(shown[:-1]) + " or " + shown[-1]) + " file"


def resample(audio: np.ndarray, orig_sr: int, new_sr: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99, block: int = 1 << 15) -> np.ndarray:
    """Band-limited resampling by windowed-sinc interpolation (torchaudio's Hann-windowed
    kernel), evaluated per output sample so any pair of integer rates works without the
    huge polyphase kernels a coprime pair (44101 -> 16000) would need. Output length is
    ceil(len * new / orig); samples outside the input count as zeros."""
    if orig_sr == new_sr:
        return audio.astype(np.float32, copy=False)
    x = np.ascontiguousarray(audio, dtype=np.float32).astype(np.float64)
    n_in = x.size
    n_out = ceil_div(n_in * new_sr, orig_sr)
    base = min(orig_sr, new_sr) * rolloff
    half = math.ceil(lowpass_filter_width * orig_sr / base)  # taps each side, in input samples
    offsets = np.arange(-half, half + 2, dtype=np.int64)
    out = np.empty(n_out, dtype=np.float64)
    for start in range(0, n_out, block):
        n = np.arange(start, min(start + block, n_out), dtype=np.int64)
        j = (n * orig_sr // new_sr)[:, None] + offsets  # [b, taps]
        # time from output sample n to input sample j, in periods of the cutoff (exact ints)
        t = (j * new_sr - n[:, None] * orig_sr).astype(np.float64) * (base / (orig_sr * new_sr))
        t = np.clip(t, -lowpass_filter_width, lowpass_filter_width)
        window = np.cos(t * (math.pi / lowpass_filter_width / 2)) ** 2
        kernel = np.sinc(t) * window * (base / orig_sr)
        vals = np.where((j >= 0) & (j < n_in), x[np.clip(j, 0, n_in - 1)], 0.0)
        out[start : start + len(n)] = (vals * kernel).sum(1)
    return out.astype(np.float32)


# -- features ------------------------------------------------------------------------------


def _hertz_to_mel_slaney(freq: float | np.ndarray) -> np.ndarray:
    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    logstep = 27.0 / np.log(6.4)
    log_region = freq >= 1000.0
    return np.where(log_region, 15.0 + np.log(np.maximum(freq, 1e-12) / 1000.0) * logstep, mels)


def _mel_to_hertz_slaney(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    freq = 200.0 * mels / 3.0
    logstep = np.log(6.4) / 27.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(logstep * (mels - 15.0)), freq)


def mel_filter_bank(num_frequency_bins: int, num_mel_filters: int, min_frequency: float,
                    max_frequency: float, sampling_rate: int) -> np.ndarray:
    """Slaney-scale triangular filters with Slaney area normalization, float64
    [num_frequency_bins, num_mel_filters]: transformers' `mel_filter_bank(...,
    norm="slaney", mel_scale="slaney")`, step for step."""
    mel_freqs = np.linspace(_hertz_to_mel_slaney(min_frequency), _hertz_to_mel_slaney(max_frequency),
                            num_mel_filters + 2)
    filter_freqs = _mel_to_hertz_slaney(mel_freqs)
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    filter_diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down = -slopes[:, :-2] / filter_diff[:-1]
    up = slopes[:, 2:] / filter_diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down, up))
    enorm = 2.0 / (filter_freqs[2 : num_mel_filters + 2] - filter_freqs[:num_mel_filters])
    return filters * np.expand_dims(enorm, 0)


_FILTERS: dict[tuple, np.ndarray] = {}


def _filters(cfg: FeatureConfig) -> np.ndarray:
    key = (cfg.n_fft, cfg.feature_size, cfg.sampling_rate)
    if key not in _FILTERS:
        _FILTERS[key] = mel_filter_bank(1 + cfg.n_fft // 2, cfg.feature_size, 0.0, 8000.0, cfg.sampling_rate)
    return _FILTERS[key]


def log_mel_features(audio: np.ndarray, cfg: FeatureConfig = FeatureConfig(), pad: bool = True) -> np.ndarray:
    """Mono samples at `cfg.sampling_rate` -> float32 [feature_size, nb_max_frames].

    As WhisperFeatureExtractor: pad (or cut) to `chunk_length` seconds with
    `padding_value`, centred STFT (reflect padding) with a periodic Hann window, power
    spectrum without the last frame, mel filters, log10 of max(., 1e-10), floor at
    max - 8, then (x + 4) / 4; in float64, returned as float32. `pad=False`: the clip as
    it is (the extractor's `padding="longest"` on one clip, as Qwen3-Omni's processor
    calls it), [feature_size, len // hop_length]."""
    wave = np.asarray(audio, dtype=np.float32).reshape(-1)
    if pad:
        wave = wave[: cfg.n_samples]
        if wave.size < cfg.n_samples:
            wave = np.pad(wave, (0, cfg.n_samples - wave.size), constant_values=cfg.padding_value)
    half = cfg.n_fft // 2
    padded = np.pad(wave.astype(np.float64), (half, half), mode="reflect")
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(cfg.n_fft) / cfg.n_fft)  # periodic Hann
    frames = np.lib.stride_tricks.sliding_window_view(padded, cfg.n_fft)[:: cfg.hop_length]
    spec = np.fft.rfft(frames * window, axis=-1)  # [frames, bins]
    power = (spec.real**2 + spec.imag**2)[:-1].T  # [bins, frames - 1]
    log_spec = np.log10(np.maximum(_filters(cfg).T @ power, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def audio_features(data: bytes, cfg: FeatureConfig = FeatureConfig()) -> np.ndarray:
    """Client audio bytes -> `input_features` [1, feature_size, nb_max_frames] float32:
    what `WhisperSpec.process_prompt` sends as the request's "input_features"."""
    samples = decode_audio(data, cfg.sampling_rate, max_seconds=cfg.chunk_length)
    return log_mel_features(samples, cfg)[None]


def to_pcm16(samples: np.ndarray) -> bytes:
    """Little-endian signed 16-bit PCM of float samples in [-1, 1] (clipped, rounded): the
    bytes a WAV body or a raw PCM stream carries."""
    scaled = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0
    return np.round(scaled).astype("<i2").tobytes()
