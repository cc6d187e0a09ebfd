"""Qwen3-TTS' speaker encoder and its mel front end
(services/gpu_worker/modeling/speech/qwen3_tts_speaker.py) against the `qwen-tts` package's
(`mel_spectrogram` with librosa's own mel filters, `extract_speaker_embedding`) on a tiny
random Base checkpoint laid out as the Hub ships one (tests/qwen3_tts_checkpoints.py)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.gpu_worker.modeling.speech.qwen3_tts_speaker import SpeakerEncoder, mel_spectrogram, slaney_mel_filters
from tests.qwen3_tts_checkpoints import librosa_path, make_qwen3_tts_checkpoint, qwen3_tts_speaker_reference

#: the first run may build the reference's venv, librosa and weights (kept after)
pytestmark = pytest.mark.timeout(600)


def _clips() -> list[np.ndarray]:
    """A noisy chord (1.3 s) and a short noise burst (0.25 s), 24 kHz, inside [-1, 1]."""
    rng = np.random.default_rng(3)
    t = np.arange(int(1.3 * 24000)) / 24000
    chord = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1375 * t) + 0.05 * rng.standard_normal(len(t))
    return [chord.astype(np.float32), (0.4 * rng.standard_normal(6000)).astype(np.float32)]


def test_speaker_encoder_equals_the_package(tmp_path):
    folder = make_qwen3_tts_checkpoint(tmp_path / "base", model_type="base")
    clips = _clips()
    want = qwen3_tts_speaker_reference(folder, clips, tmp_path / "ref")
    encoder = SpeakerEncoder(json.loads((folder / "config.json").read_text())["speaker_encoder_config"])
    encoder.load_weights(load_file(str(folder / "model.safetensors")))
    for clip, (mel, emb) in zip(clips, want):
        got_mel = mel_spectrogram(torch.from_numpy(clip)[None])[0].numpy()
        assert got_mel.shape == mel.shape
        np.testing.assert_allclose(got_mel, mel, atol=1e-5, rtol=0)
        got = encoder.embed(clip).numpy()
        assert got.shape == emb.shape == (32,) and float(np.abs(emb).max()) > 1e-2
        np.testing.assert_allclose(got, emb, atol=1e-5, rtol=0)
    a, b = (encoder.embed(c).numpy() for c in clips)
    assert not np.allclose(a, b, atol=1e-3)  # clips differ, so do their x-vectors


def test_mel_filters_are_librosas():
    """The Slaney filters bit for bit as librosa's (the one the reference's venv gets)."""
    folder = str(librosa_path())
    sys.path.append(folder)
    try:
        from librosa.filters import mel
    finally:
        sys.path.remove(folder)
    for sr, n_fft, n_mels, fmin, fmax in ((24000, 1024, 128, 0, 12000), (16000, 400, 80, 20, 7600)):
        want = mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
        np.testing.assert_array_equal(slaney_mel_filters(sr, n_fft, n_mels, fmin, fmax), want)
