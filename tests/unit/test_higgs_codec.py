"""Higgs Audio v2's codec decoder (services/gpu_worker/codecs/higgs_codec.py) against
transformers' `HiggsAudioV2TokenizerModel.decode` on a tiny random codec with the real
rates: the whole clip, a stream pushed in uneven chunks joining into it, a receptive
radius too small caught, and weight norm (as older files carry it) folded to the same
sound; where the codec folder is found (shared/specs/higgs.py `find_codec`); the delay
pattern's bookkeeping against transformers' logits processor."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from services.gpu_worker.codecs.higgs_codec import HiggsCodec
from shared.specs.base import DeploymentError
from shared.specs.higgs import find_codec
from tests.higgs_checkpoints import _codec_class, hub_cache_folder, make_higgs_codec

FRAMES = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_higgs_codec(tmp_path_factory.mktemp("xcodec") / "codec")


@pytest.fixture(scope="module")
def decoded(folder):
    _, cls = _codec_class()
    model = cls.from_pretrained(folder).eval()
    codes = torch.randint(0, 1024, (FRAMES, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.decode(codes.t().unsqueeze(0)).audio_values.reshape(-1).numpy()
    return codes.numpy(), ref


def _codec(folder) -> HiggsCodec:
    return HiggsCodec(folder, json.loads((folder / "config.json").read_text()))


def test_decode_equals_transformers(folder, decoded):
    codes, ref = decoded
    got = _codec(folder).decode(codes)
    assert got.shape == ref.shape == (FRAMES * 960,) and np.abs(ref).max() > 0.05
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_stream_joins_into_the_whole(folder, decoded):
    codes, ref = decoded
    codec = _codec(folder)
    assert codec.radius == 13
    stream = codec.stream(min_chunk_frames=3)
    sizes = [1, 2, 5, 1, 7, 3, 11, 10]
    at, chunks = 0, []
    for n in sizes:
        chunks.append(stream.push(codes[at: at + n]))
        at += n
    chunks.append(stream.finish())
    assert sum(1 for c in chunks if len(c)) > 3
    np.testing.assert_allclose(np.concatenate(chunks), ref, atol=1e-4, rtol=0)
    codec.radius = 6  # too short a context: the window's edges leak into the samples sent
    stream = codec.stream(min_chunk_frames=8)
    short = np.concatenate([stream.push(codes[i: i + 4]) for i in range(0, FRAMES, 4)] + [stream.finish()])
    assert np.abs(short - ref).max() > 1e-3


def test_weight_norm_is_folded(folder, decoded, tmp_path):
    """A file with `weight_g` / `weight_v` (weight norm, as older torch saved it) decodes the same."""
    from safetensors.torch import load_file, save_file

    codes, ref = decoded
    state = load_file(folder / "model.safetensors")
    name = "acoustic_decoder.block.0.conv_t1.weight"
    w = state.pop(name)
    g = torch.linalg.vector_norm(w, dim=(1, 2), keepdim=True)  # v is w scaled: g / |v| undoes it
    state[name[:-len("weight")] + "weight_g"], state[name[:-len("weight")] + "weight_v"] = g, w * 2.0
    save_file(state, tmp_path / "model.safetensors")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    np.testing.assert_allclose(_codec(tmp_path).decode(codes), ref, atol=1e-4, rtol=0)


def test_the_codec_is_found_inside_the_folder_or_in_the_hub_cache(tmp_path, monkeypatch):
    repo = "bosonai/higgs-audio-v2-tokenizer"
    model = tmp_path / "model"
    model.mkdir()
    (model / "processor_config.json").write_text(json.dumps({"audio_tokenizer": {
        "audio_tokenizer_class": "HiggsAudioV2TokenizerModel", "audio_tokenizer_name_or_path": repo}}))
    with pytest.raises(DeploymentError, match="not in the Hugging Face cache"):
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty"))
        find_codec(model)
    cached = hub_cache_folder(tmp_path / "hub", repo)
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert find_codec(model) == cached
    inside = model / "higgs-audio-v2-tokenizer"
    inside.mkdir()
    (inside / "config.json").write_text("{}")
    assert find_codec(model) == inside  # the checkpoint's own folder wins


def test_delay_pattern_equals_transformers_processor():
    """`DelayPattern` forces the codebooks transformers' processor masks, frame after frame,
    through a frame with an EOS in codebook 0 and the delay that follows it."""
    import importlib

    from services.gpu_worker.runners.higgs import DelayPattern

    gen = importlib.import_module("transformers.models.higgs_audio_v2.generation_higgs_audio_v2")

    class Spec:
        num_codebooks, stream_bos, stream_eos = 8, 1024, 1025
        audio_token_id, audio_bos_token_id, audio_delay_token_id = 7, 5, 6

    proc = gen.HiggsAudioV2DelayPatternLogitsProcessor([k + 1 for k in range(8)], 5, 6, 1024, 1025, 8, 1026)
    ids = [1, 2, 3, 4, 9, 9, 9, 9, 9, 5]
    ours = DelayPattern(Spec, ids)
    rng = np.random.default_rng(0)
    for step in range(21):
        scores = proc(torch.tensor([ids]), torch.zeros(1, 8 * 1026))
        bos, eos = ours.forced()
        assert np.array_equal(bos, (scores[:, 1024] == 0).numpy() & (scores[:, 0] != 0).numpy()), step
        assert np.array_equal(eos, (scores[:, 1025] == 0).numpy() & (scores[:, 0] != 0).numpy()), step
        codes = [1025 if e or (step == 12 and k == 0) else 1024 if b else int(rng.integers(0, 1024))
                 for k, (b, e) in enumerate(zip(bos, eos))]
        done = ours.advance(codes)
        ids.append(ours.last if not done else 99)
        assert done == (step == 20)
        if done:
            break
