"""The Mimi decoder (services/gpu_worker/codecs/mimi_codec.py) against transformers'
`MimiModel.decode` on a tiny random codec with Mimi's rates: the whole clip, and a stream
pushed in uneven chunks (past the transformer's sliding window) concatenating to it. The
encoder (codecs/mimi_encoder.py) against `MimiModel.encode`: the same codes, exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.gpu_worker.codecs.mimi_codec import MimiCodec
from services.gpu_worker.codecs.mimi_encoder import MimiEncoder
from tests.tts_checkpoints import make_csm_checkpoint

FRAMES = 30


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # a window of 8 positions (4 frames) so the stream's chunks cross it many times
    return make_csm_checkpoint(tmp_path_factory.mktemp("mimi") / "csm", num_codebooks=8, mimi={"sliding_window": 8})


@pytest.fixture(scope="module")
def decoded(ckpt):
    import transformers

    codec_model = transformers.CsmForConditionalGeneration.from_pretrained(ckpt).codec_model.eval()
    codes = torch.randint(0, 64, (FRAMES, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = codec_model.decode(codes.t().unsqueeze(0)).audio_values[0, 0].numpy()
    return codes.numpy(), ref


def _codec(ckpt) -> MimiCodec:
    return MimiCodec(ckpt, json.loads((ckpt / "config.json").read_text())["codec_config"])


def test_whole_clip_equals_transformers(ckpt, decoded):
    codes, ref = decoded
    codec = _codec(ckpt)
    assert codec.samples_per_frame == 1920 and codec.sample_rate == 24000
    out = codec.decode(codes)
    assert out.shape == ref.shape == (FRAMES * 1920,)
    np.testing.assert_allclose(out, ref, atol=1e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("sizes", [[1] * FRAMES, [1, 3, 4, 4, 7, 11], [5, 25]])
def test_stream_concatenates_to_the_clip(ckpt, decoded, sizes):
    codes, ref = decoded
    stream = _codec(ckpt).stream()
    parts, at = [], 0
    for n in sizes:
        chunk = stream.push(codes[at: at + n])
        assert len(chunk) == n * 1920  # every frame's samples are final at once (all causal)
        parts.append(chunk)
        at += n
    out = np.concatenate([*parts, stream.finish()])
    np.testing.assert_allclose(out, ref, atol=1e-5 * float(np.abs(ref).max()))


def test_chunks_gather_and_codes_are_checked(ckpt, decoded):
    codes, _ = decoded
    stream = _codec(ckpt).stream(4 * 1920)
    assert [len(stream.push(codes[i: i + 1])) for i in range(4)] == [0, 0, 0, 4 * 1920]
    assert len(stream.push(codes[4:5])) == 0 and len(stream.finish()) == 1920
    with pytest.raises(ValueError):
        stream.push(np.full((1, 8), 64))


@pytest.mark.parametrize("samples", [1, 1919, 1921, 5000, 30 * 1920 + 7])
def test_encoder_codes_equal_transformers(ckpt, decoded, samples):
    """Noisy tones and a decoded clip (sound as Mimi makes it), at lengths around a frame's
    and past the encoder transformer's window: codes equal (they are argmins), the frame
    count is transformers' `get_encoded_length`."""
    import transformers

    codec_model = transformers.CsmForConditionalGeneration.from_pretrained(ckpt).codec_model.eval()
    encoder = MimiEncoder(ckpt, json.loads((ckpt / "config.json").read_text())["codec_config"])
    rng = np.random.default_rng(samples)
    t = np.arange(samples)
    tone = (0.3 * np.sin(t * 0.05) + 0.05 * rng.standard_normal(samples)).astype(np.float32)
    clip = np.resize(decoded[1], samples) / max(1e-6, float(np.abs(decoded[1]).max()))  # repeated past its end
    for x in (tone, clip.astype(np.float32)):
        with torch.no_grad():
            want = codec_model.encode(torch.from_numpy(x).view(1, 1, -1)).audio_codes[0].t().numpy()
        got = encoder.encode(x)
        assert got.shape == want.shape == (-(-samples // 1920), 8)  # ceil: a frame per 1920 samples begun
        assert int(codec_model.get_encoded_length(torch.tensor(samples))) == len(got)
        np.testing.assert_array_equal(got, want)
