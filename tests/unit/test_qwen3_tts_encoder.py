"""Qwen3-TTS' 12 Hz codec encoder (services/gpu_worker/codecs/qwen3_tts_encoder.py) against
the `qwen-tts` package's `speech_tokenizer.encode` (what `create_voice_clone_prompt` makes
`ref_code` with) on the tiny random Base checkpoint laid out as the Hub ships one
(tests/qwen3_tts_checkpoints.py): codes are integers, so equal exactly."""

from __future__ import annotations

import numpy as np
import pytest

from services.gpu_worker.codecs.qwen3_tts_encoder import Qwen3TTSEncoder
from tests.qwen3_tts_checkpoints import make_qwen3_tts_checkpoint, qwen3_tts_encode_reference

#: the first run may build the reference's venv and weights (kept after)
pytestmark = pytest.mark.timeout(600)


def _clips() -> list[np.ndarray]:
    """A noisy chord of a whole number of frames (0.2 s: 100 frames of 48 samples), a
    noise burst that is not (1001 samples), and one frame's worth less a sample."""
    rng = np.random.default_rng(7)
    t = np.arange(4800) / 24000
    chord = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.2 * np.sin(2 * np.pi * 990 * t) + 0.05 * rng.standard_normal(len(t))
    return [chord.astype(np.float32), (0.4 * rng.standard_normal(1001)).astype(np.float32),
            (0.2 * rng.standard_normal(47)).astype(np.float32)]


def test_codes_equal_the_package(tmp_path):
    folder = make_qwen3_tts_checkpoint(tmp_path / "base", model_type="base")
    clips = _clips()
    want = qwen3_tts_encode_reference(folder, clips, tmp_path / "ref")
    encoder = Qwen3TTSEncoder(folder)
    for clip, codes in zip(clips, want):
        got = encoder.encode(clip)
        assert got.shape == codes.shape == (encoder.frames(len(clip)), 4), (got.shape, codes.shape)
        np.testing.assert_array_equal(got, codes)
    assert len(np.unique(want[0][:, 0])) > 4  # the codes vary: nothing is flat
