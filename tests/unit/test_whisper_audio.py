"""shared/audio.py: features equal transformers' WhisperFeatureExtractor, decoding and
resampling of WAV/FLAC, and client-safe refusals of bad audio."""

from __future__ import annotations

import numpy as np
import pytest

from shared.audio import (
    FeatureConfig,
    audio_features,
    decode_audio,
    log_mel_features,
    mel_filter_bank,
    resample,
)
from tests.whisper_checkpoints import sine_sweep, wav_bytes

transformers = pytest.importorskip("transformers")
pytest.importorskip("soundfile")


@pytest.fixture(scope="module")
def extractor():
    return transformers.WhisperFeatureExtractor()


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filter_bank_equals_transformers(n_mels):
    from transformers.audio_utils import mel_filter_bank as hf_bank

    ours = mel_filter_bank(201, n_mels, 0.0, 8000.0, 16000)
    ref = hf_bank(201, n_mels, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
    assert ours.shape == ref.shape == (201, n_mels)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seconds", [0.01, 1.0, 7.3, 30.0, 31.0])
def test_features_equal_whisper_feature_extractor(extractor, seconds):
    rng = np.random.default_rng(int(seconds * 100))
    audio = (rng.standard_normal(int(seconds * 16000)) * rng.uniform(0.01, 0.5)).astype(np.float32)
    ref = extractor(audio, sampling_rate=16000, return_tensors="np").input_features
    ours = log_mel_features(audio, FeatureConfig())[None]
    assert ours.shape == ref.shape == (1, 80, 3000)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_features_with_128_mels_equal_transformers():
    fe = transformers.WhisperFeatureExtractor(feature_size=128)
    audio = sine_sweep(2.5)
    ref = fe(audio, sampling_rate=16000, return_tensors="np").input_features
    np.testing.assert_allclose(log_mel_features(audio, FeatureConfig(feature_size=128))[None], ref, rtol=0, atol=1e-4)


def test_feature_config_from_saved_extractor(tmp_path):
    transformers.WhisperFeatureExtractor(feature_size=128).save_pretrained(tmp_path)
    cfg = FeatureConfig.from_folder(tmp_path)
    assert (cfg.feature_size, cfg.sampling_rate, cfg.hop_length, cfg.n_fft, cfg.chunk_length) == (
        128, 16000, 160, 400, 30)
    assert (cfg.n_samples, cfg.nb_max_frames) == (480000, 3000)
    assert FeatureConfig.from_folder(tmp_path / "nothing-here", feature_size=80) == FeatureConfig()


@pytest.mark.parametrize(("fmt", "subtype", "tol"), [("WAV", "PCM_16", 1 / 32768), ("WAV", "FLOAT", 0),
                                                     ("FLAC", "PCM_24", 1 / 2**23)])
def test_decode_wav_and_flac(extractor, fmt, subtype, tol):
    audio = sine_sweep(2.0)
    data = wav_bytes(audio, 16000, fmt, subtype)
    got = decode_audio(data, 16000)
    assert got.dtype == np.float32 and got.shape == audio.shape
    np.testing.assert_allclose(got, audio, rtol=0, atol=tol + 1e-7)
    feats = audio_features(data, FeatureConfig())
    ref = extractor(got, sampling_rate=16000, return_tensors="np").input_features
    np.testing.assert_allclose(feats, ref, rtol=0, atol=1e-4)


def test_stereo_is_averaged_to_mono():
    left, right = sine_sweep(1.0, seed=1), sine_sweep(1.0, f0=500, seed=2)
    got = decode_audio(wav_bytes(np.stack([left, right], axis=1), 16000, "WAV", "FLOAT"), 16000)
    np.testing.assert_allclose(got, (left + right) / 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("orig", [8000, 22050, 44100, 48000, 44101])
def test_resampling_keeps_a_tone(orig):
    """A 1 kHz tone resampled to 16 kHz matches the tone sampled at 16 kHz (edges aside)."""
    t = np.arange(int(orig * 0.25)) / orig
    tone = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    got = resample(tone, orig, 16000)
    assert len(got) == -(-len(tone) * 16000 // orig)
    want = np.sin(2 * np.pi * 1000 * np.arange(len(got)) / 16000)
    np.testing.assert_allclose(got[100:-100], want[100:-100], rtol=0, atol=2e-3)


@pytest.mark.parametrize("freq", [10000, 12000, 20000])
def test_resampling_removes_what_the_new_rate_cannot_hold(freq):
    """Tones past 16 kHz's Nyquist (beyond the kernel's transition band, which ends near
    10 kHz for the default 6 zero crossings) vanish instead of aliasing below 8 kHz."""
    t = np.arange(48000 // 4) / 48000
    above = resample(np.sin(2 * np.pi * freq * t).astype(np.float32), 48000, 16000)
    assert np.abs(above[200:-200]).max() < 0.01


def test_decode_resamples_to_the_extractor_rate():
    audio = sine_sweep(1.0, sr=44100, f1=3000)
    got = decode_audio(wav_bytes(audio, 44100, "WAV", "FLOAT"), 16000)
    np.testing.assert_allclose(got, resample(audio, 44100, 16000), rtol=0, atol=1e-6)
    assert len(got) == 16000


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"RIFF\x00\x00garbage" * 10, "could not be decoded"),
        (bytes(range(256)) * 4, "could not be decoded"),
    ],
)
def test_bad_bytes_are_refused_with_a_client_safe_message(data, message):
    with pytest.raises(ValueError, match=message):
        decode_audio(data, 16000)


def test_too_long_audio_is_refused_before_decoding():
    data = wav_bytes(np.zeros(16000 * 31, dtype=np.float32), 16000, "WAV", "PCM_16")
    with pytest.raises(ValueError, match=r"31\.00 s long; this model transcribes at most 30 s"):
        audio_features(data, FeatureConfig())
    assert audio_features(wav_bytes(np.zeros(16000 * 30, dtype=np.float32)), FeatureConfig()).shape == (1, 80, 3000)


def test_non_finite_samples_are_refused():
    audio = sine_sweep(0.5)
    audio[100] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        decode_audio(wav_bytes(audio, 16000, "WAV", "FLOAT"), 16000)


def test_other_containers_and_silly_rates_are_refused():
    with pytest.raises(ValueError, match="AIFF is not supported; send a WAV or FLAC"):
        decode_audio(wav_bytes(sine_sweep(0.2), 16000, "AIFF", "PCM_16"), 16000)
    with pytest.raises(ValueError, match="sampling rate 500 Hz"):
        decode_audio(wav_bytes(np.zeros(500, dtype=np.float32), 500, "WAV", "PCM_16"), 16000)
    with pytest.raises(ValueError, match="no samples"):
        decode_audio(wav_bytes(np.zeros(0, dtype=np.float32), 16000, "WAV", "PCM_16"), 16000)
