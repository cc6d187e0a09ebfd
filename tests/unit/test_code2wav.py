"""Qwen3-Omni's Code2Wav (services/gpu_worker/codecs/code2wav.py) against transformers'
`Qwen3OmniMoeCode2Wav` on a tiny random codec (every scale, snake and norm parameter
random, so no path hides behind an init of 0 or 1): a short clip against `forward`, a clip
past one 300-frame chunk against `chunked_decode` (what `generate(return_audio=True)`
runs), and streams pushed in uneven pieces joining to the whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.gpu_worker.codecs.code2wav import Code2WavCodec

CONFIG = dict(codebook_size=32, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=48,
              num_hidden_layers=2, num_quantizers=4, decoder_dim=16, upsample_rates=[3, 2], upsampling_ratios=[2, 2],
              sliding_window=8)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    torch.manual_seed(0)
    model = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".alpha", ".beta", "gamma", ".scale", "norm.weight", ".bias")):
                param.normal_(0.0 if name.endswith((".alpha", ".beta", ".bias")) else 0.5, 0.3)
    folder = tmp_path_factory.mktemp("code2wav")
    save_file({f"code2wav.{k}": v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    return model, Code2WavCodec(folder, CONFIG)


def _codes(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32, size=(frames, 4))


def test_short_clip_equals_forward(reference):
    model, codec = reference
    codes = _codes(40, 1)
    with torch.no_grad():
        ref = model(torch.from_numpy(codes.T[None])).reshape(-1).numpy()
    out = codec.decode(codes)
    assert codec.samples_per_frame == 24 and out.shape == ref.shape and len(out) < 40 * 24
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_long_clip_equals_chunked_decode(reference):
    model, codec = reference
    codes = _codes(340, 2)
    with torch.no_grad():
        ref = model.chunked_decode(torch.from_numpy(codes.T[None]), chunk_size=300, left_context_size=25)
    ref = ref.reshape(-1).numpy()
    out = codec.decode(codes)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize(("sizes", "min_frames"), [([1] * 12 + [298, 30], 1), ([7, 293, 1, 39], 4)])
def test_stream_joins_to_the_clip(reference, sizes, min_frames):
    _, codec = reference
    codes = _codes(sum(sizes), 2)
    stream, parts, at = codec.stream(min_frames), [], 0
    for n in sizes:
        parts.append(stream.push(codes[at: at + n]))
        at += n
    parts.append(stream.finish())
    assert sum(len(p) > 0 for p in parts) > 2
    np.testing.assert_allclose(np.concatenate(parts), codec.decode(codes), atol=1e-6)


def test_codes_out_of_range_are_refused(reference):
    with pytest.raises(ValueError, match="codes must be in"):
        reference[1].decode(np.full((3, 4), 32))
