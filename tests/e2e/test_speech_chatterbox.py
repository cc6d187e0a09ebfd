"""Chatterbox (T3) through the real services: a tiny random checkpoint laid out as the Hub
ships ResembleAI/chatterbox (tests/chatterbox_checkpoints.py), its reference the
`chatterbox-tts` package run in its own venv.

- tokens: `/generate`'s tokens equal T3's speech tokens from `ChatterboxTTS.generate` under
  the same seed (its sampling: CFG, repetition penalty, temperature, min-p, top-p, then
  `torch.multinomial`; mstar draws with the request's seeded CPU generator), the package's
  defaults; 4 requests at once, then one alone again; and greedy (temperature 0; the
  package at 1e-4, where min-p leaves one token);
- the speech route (pcm whole, SSE) with its extensions `exaggeration` and `cfg_weight` and
  without: the package's waveforms with and without them; bad values are refused naming
  the field;
- a reference clip (one `context` turn, 24 kHz WAV): the conditionals mstar makes of it
  (modeling/speech/chatterbox_clip.py) equal the package's `prepare_conditionals` (speaker
  embedding and prompt mel within 1e-5, x-vector within 1e-5 of its scale, S3 tokens
  exact); through `/generate` two clips at once each equal the package's
  `generate(audio_prompt_path=...)` under the same seed (tokens exact, waveform within
  1e-3); the same clip twice through the speech route gives identical bytes; a clip that
  is not audio is a 400 naming `context[0].audio`;
- debug asserts on, pages back to 0.

- sound: each sampled request's audio (S3Gen in the codec thread, its noise continuing the
  request's generator) equals the package's waveform within 1e-3; S3Gen's flow and vocoder
  also each from the package's RNG state.

Greedy requests are held to tokens only (mstar's argmax draws nothing; the package's
temperature 1e-4 still draws, which moves S3Gen's noise).
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.chatterbox_checkpoints import (
    CLIP_KEYS,
    chatterbox_reference,
    make_chatterbox_checkpoint,
    speech_clip,
    wav_bytes,
)
from tests.servers import MstarServer

TEXTS = ("Hello world!", "the quick brown fox jumps over the lazy dog", "Numbers like 12345...",
         "What is the capital of France?")
TOKENS = 24
#: the package's generate defaults, sent to /generate (its own defaults are not the package's)
DEFAULTS = {"temperature": 0.8, "repetition_penalty": 1.2, "min_p": 0.05, "top_p": 1.0}
#: (text, seed, exaggeration, cfg_weight) through the speech route
EXTENDED = (TEXTS[1], 7, 1.2, 0.3)
#: reference clips (24 kHz WAV: 3 s and 2.2 s) and the (clip, text, seed) cases cloned from them
CLIPS = (wav_bytes(speech_clip(3.0, 1)), wav_bytes(speech_clip(2.2, 2)))
CLONED = ((0, TEXTS[0], 21), (1, TEXTS[3], 22))
FIRST_CLONED = 7  # the reference's index of CLONED[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_chatterbox_checkpoint(tmp_path_factory.mktemp("chatterbox") / "cb")


def _cases(work: Path) -> list[dict]:
    """The package's runs: S3Gen's only where a waveform is compared."""
    base = {"max_new_tokens": TOKENS, "wave": False, **DEFAULTS}
    cases = [{"text": t, "seed": 10 + i, **base, "wave": True} for i, t in enumerate(TEXTS)]
    text, seed, exaggeration, cfg_weight = EXTENDED
    cases.append({"text": text, "seed": seed, **base, "exaggeration": exaggeration, "cfg_weight": cfg_weight,
                  "wave": True})
    cases.append({"text": text, "seed": seed, **base, "wave": True})
    # greedy: the package at temperature 1e-4 (min-p then keeps the top token alone); mstar at 0
    cases.append({"text": TEXTS[2], "seed": 3, **base, "temperature": 1e-4})
    work.mkdir(parents=True, exist_ok=True)
    for i, clip in enumerate(CLIPS):
        (work / f"clip{i}.wav").write_bytes(clip)
    cases += [{"text": text, "seed": seed, **base, "wave": True, "clip": str(work / f"clip{c}.wav")}
              for c, text, seed in CLONED]
    return cases


@pytest.fixture(scope="module")
def stack(folder, tmp_path_factory):
    """The services start while the package computes the reference."""
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "chatterbox.log", "--num-kv-pages", "64",
                      "--page-size", "16", "--max-seq-len", "160", "--max-batch-tokens", "64",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).launch()
    try:
        work = tmp_path_factory.mktemp("chatterbox-ref")
        reference = chatterbox_reference(folder, _cases(work / "clips"), work)
        srv.wait_ready()
        yield srv, reference
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(stack) -> MstarServer:
    return stack[0]


@pytest.fixture(scope="module")
def reference(stack) -> list[dict]:
    return stack[1]


async def _generate(client: httpx.AsyncClient, i: int) -> httpx.Response:
    return await client.post("/generate", json={"prompt": TEXTS[i], "seed": 10 + i, "max_tokens": TOKENS,
                                                **DEFAULTS})


async def test_tokens_equal_the_package_seeded(server, reference):
    """All 4 at once (prompt chunks beside decode rows, both row sets each), then the
    first alone: each equals the package's tokens under its seed."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        together = await asyncio.gather(*(_generate(client, i) for i in range(len(TEXTS))))
        alone = await _generate(client, 0)
        greedy = await client.post("/generate", json={"prompt": TEXTS[2], "max_tokens": TOKENS,
                                                      **DEFAULTS, "temperature": 0})
    assert greedy.json()["token_ids"] == reference[6]["tokens"].tolist()
    for i, r in enumerate(together):
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == reference[i]["tokens"].tolist(), TEXTS[i]
        audio = np.frombuffer(base64.b64decode(r.json()["audio"]), "<f4")
        wave = reference[i]["wave"]
        assert audio.shape == wave.shape and np.abs(wave).max() > 0.01
        np.testing.assert_allclose(audio, wave, atol=1e-3, rtol=0)
    assert alone.json()["token_ids"] == together[0].json()["token_ids"]
    assert alone.json()["audio"] == together[0].json()["audio"]
    server.assert_clean()


async def test_speech_route_extensions_and_refusals(server, reference):
    """`exaggeration` / `cfg_weight` reach T3 and the route's defaults are the package's
    (pcm whole with them, SSE without: each the package's waveform, its usage the package's
    token count); bad values and voices are 400s naming the field."""
    text, seed, exaggeration, cfg_weight = EXTENDED
    body = {"input": text, "seed": seed, "max_tokens": TOKENS, "response_format": "pcm"}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        with_ext = await client.post("/v1/audio/speech", json={**body, "exaggeration": exaggeration,
                                                               "cfg_weight": cfg_weight})
        plain = await client.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
        bad = [await client.post("/v1/audio/speech", json={**body, **field})
               for field in ({"exaggeration": 2.5}, {"cfg_weight": -1}, {"voice": "someone"})]
    assert with_ext.status_code == 200 and plain.status_code == 200, with_ext.text + plain.text
    events = [json.loads(line[6:]) for line in plain.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] == len(reference[5]["tokens"])
    streamed = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    for got, ref in ((with_ext.content, reference[4]), (streamed, reference[5])):
        want = (np.clip(ref["wave"], -1, 1) * 32767).round().astype("<i2")
        pcm = np.frombuffer(got, "<i2")
        assert len(pcm) == len(want) > 0 and np.abs(pcm.astype(int) - want).max() <= 33  # 1e-3 of full scale
    assert reference[4]["tokens"].tolist() != reference[5]["tokens"].tolist()
    for r, param in zip(bad, ("exaggeration", "cfg_weight", "voice")):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    server.assert_clean()


def test_s3gen_halves_equal_the_package(folder, reference):
    """S3Gen's flow (codecs/s3gen_flow.py) and vocoder (codecs/s3gen_hift.py), each from the
    package's RNG state before it: the package's mel and vocoder output within 1e-5."""
    import torch

    from services.gpu_worker.codecs.s3gen import S3Gen

    ref = reference[0]
    s3gen = S3Gen(folder, torch.device("cpu"))
    prompt_tokens, prompt_feat, xvector = s3gen.voice
    gen = torch.Generator()
    with torch.inference_mode():
        gen.set_state(torch.from_numpy(ref["flow_rng"]))
        mel = s3gen.flow(torch.from_numpy(ref["s3_tokens"])[None], prompt_tokens, prompt_feat, xvector, gen).numpy()
        gen.set_state(torch.from_numpy(ref["rng"]))
        wave = s3gen.hift(torch.from_numpy(ref["mel"]), gen).numpy()
    assert mel.shape == ref["mel"].shape and wave.shape == ref["hift"].shape and np.abs(ref["hift"]).max() > 0.01
    np.testing.assert_allclose(mel, ref["mel"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(wave, ref["hift"], atol=1e-5, rtol=0)


def test_clip_conditionals_equal_the_package(folder, reference):
    """A clip's conditionals (resampling, voice encoder, S3 tokenizer, S3Gen's mel, CAMPPlus
    over Kaldi fbank) as the package's `prepare_conditionals` makes them."""
    from services.gpu_worker.modeling.speech.chatterbox_clip import ChatterboxClip
    from shared.audio import decode_audio

    clips = ChatterboxClip(folder)
    for i, (c, _, _) in enumerate(CLONED):
        ref = reference[FIRST_CLONED + i]
        got = clips.encode(decode_audio(CLIPS[c], 24000))
        for key in CLIP_KEYS:
            mine, want = getattr(got, key).numpy(), ref[key]
            assert mine.shape == want.shape, key
            if key.endswith("token") or key.endswith("tokens"):
                assert mine.tolist() == want.tolist(), key
            else:
                np.testing.assert_allclose(mine, want, atol=1e-5 * max(1.0, float(np.abs(want).max())), rtol=0,
                                           err_msg=key)


async def test_clip_voice_equals_the_package(server, reference):
    """Two clips at once through /generate: the package's tokens and waveform under the
    same seed; one clip twice through the speech route: the same bytes; a clip that is not
    audio: 400 naming `context[0].audio`."""
    def clip(c: int) -> list[dict]:
        return [{"audio": base64.b64encode(CLIPS[c]).decode()}]

    body = {"max_tokens": TOKENS, **DEFAULTS}
    speech = {"input": CLONED[0][1], "seed": CLONED[0][2], "max_tokens": TOKENS, "response_format": "pcm",
              "context": clip(CLONED[0][0])}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        got = await asyncio.gather(*(client.post("/generate", json={"prompt": text, "seed": seed, "context": clip(c),
                                                                    **body}) for c, text, seed in CLONED))
        twice = [await client.post("/v1/audio/speech", json=speech) for _ in range(2)]
        bad = await client.post("/v1/audio/speech", json={**speech, "context": [
            {"audio": base64.b64encode(b"not a sound file").decode()}]})
    for i, r in enumerate(got):
        ref = reference[FIRST_CLONED + i]
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == ref["tokens"].tolist()
        audio = np.frombuffer(base64.b64decode(r.json()["audio"]), "<f4")
        assert audio.shape == ref["wave"].shape and np.abs(ref["wave"]).max() > 0.01
        np.testing.assert_allclose(audio, ref["wave"], atol=1e-3, rtol=0)
    assert twice[0].status_code == 200 and twice[0].content == twice[1].content, twice[0].text
    want = (np.clip(reference[FIRST_CLONED]["wave"], -1, 1) * 32767).round().astype("<i2")
    pcm = np.frombuffer(twice[0].content, "<i2")
    assert len(pcm) == len(want) and np.abs(pcm.astype(int) - want).max() <= 33
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "context[0].audio", bad.text
    server.assert_clean()
