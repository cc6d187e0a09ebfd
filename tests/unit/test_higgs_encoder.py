"""Higgs Audio v2's codec encoder (services/gpu_worker/codecs/higgs_encoder.py) against
transformers' `HiggsAudioV2TokenizerModel.encode` on a tiny random codec with the real
rates and a 24 -> 16 kHz semantic path (torchaudio's resample transcribed where the venv
lacks torchaudio: tests/higgs_checkpoints.py): the same codes, for clips whose lengths
take both of the acoustic path's branches (padded and not)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.gpu_worker.codecs.higgs_encoder import HiggsEncoder, resample
from tests.higgs_checkpoints import _codec_class, _torchaudio_resample, make_higgs_codec
from tests.tts_checkpoints import chirp


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_higgs_codec(tmp_path_factory.mktemp("xcodec") / "codec")


def test_resample_equals_torchaudio_s():
    x = torch.from_numpy(chirp(5000, 220))
    np.testing.assert_allclose(resample(x, 24000, 16000).numpy(), _torchaudio_resample(x, 24000, 16000).numpy(),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("samples", [9600, 10000, 7777])
def test_codes_equal_transformers(folder, samples):
    _, cls = _codec_class()
    model = cls.from_pretrained(folder).eval()
    clip = chirp(samples, 200 + samples % 300)
    with torch.no_grad():
        want = model.encode(torch.from_numpy(clip)[None, None]).audio_codes[0].t().numpy()
    got = HiggsEncoder(folder, json.loads((folder / "config.json").read_text())).encode(clip)
    assert got.shape == want.shape and want.shape[1] == 8
    assert np.array_equal(got, want)
