"""Chatterbox (T3) through the real services: a tiny random checkpoint laid out as the Hub
ships ResembleAI/chatterbox (tests/chatterbox_checkpoints.py), its reference the
`chatterbox-tts` package run in its own venv.

- tokens: `/generate`'s tokens equal T3's speech tokens from `ChatterboxTTS.generate` under
  the same seed (its sampling: CFG, repetition penalty, temperature, min-p, top-p, then
  `torch.multinomial`; mstar draws with the request's seeded CPU generator), the package's
  defaults; 4 requests at once, then one alone again; and greedy (temperature 0; the
  package at 1e-4, where min-p leaves one token);
- the speech route's extensions `exaggeration` and `cfg_weight` change the tokens as the
  package's do (their usage's token count), and bad values are refused naming the field;
- debug asserts on, pages back to 0.

Not yet: the sound (S3Gen and its vocoder are not ported: the outputs carry tokens only).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.chatterbox_checkpoints import chatterbox_configs, chatterbox_reference
from tests.servers import MstarServer

TEXTS = ("Hello world!", "the quick brown fox jumps over the lazy dog", "Numbers like 12345...",
         "What is the capital of France?")
TOKENS = 24
#: the package's generate defaults, sent to /generate (its own defaults are not the package's)
DEFAULTS = {"temperature": 0.8, "repetition_penalty": 1.2, "min_p": 0.05, "top_p": 1.0}
#: (text, seed, exaggeration, cfg_weight) through the speech route
EXTENDED = (TEXTS[1], 7, 1.2, 0.3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return chatterbox_configs(tmp_path_factory.mktemp("chatterbox") / "cb")


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory):
    """The package's tokens (its weights are written by the same run); S3Gen is skipped."""
    base = {"max_new_tokens": TOKENS, "wave": False, **DEFAULTS}
    cases = [{"text": t, "seed": 10 + i, **base} for i, t in enumerate(TEXTS)]
    text, seed, exaggeration, cfg_weight = EXTENDED
    cases.append({"text": text, "seed": seed, **base, "exaggeration": exaggeration, "cfg_weight": cfg_weight})
    cases.append({"text": text, "seed": seed, **base})
    # greedy: the package at temperature 1e-4 (min-p then keeps the top token alone); mstar at 0
    cases.append({"text": TEXTS[2], "seed": 3, **base, "temperature": 1e-4})
    # S3Gen run whole once: its vocoder's input, RNG state and output
    cases.append({"text": TEXTS[0], "seed": 5, **base, "max_new_tokens": 12, "wave": True})
    return chatterbox_reference(folder, cases, tmp_path_factory.mktemp("chatterbox-ref"))


@pytest.fixture(scope="module")
def server(folder, reference, tmp_path_factory):
    srv = MstarServer(str(folder), tmp_path_factory.mktemp("logs") / "chatterbox.log", "--num-kv-pages", "64",
                      "--page-size", "16", "--max-seq-len", "160", "--max-batch-tokens", "64",
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    yield srv
    srv.stop()


def _clean(server: MstarServer) -> None:
    assert server.wait_pages_free() == 0
    log = server.log()
    assert "footprint overrun" not in log and "not tight" not in log and "failed (error_id=" not in log


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
    assert alone.json()["token_ids"] == together[0].json()["token_ids"]
    _clean(server)


async def test_speech_route_extensions_and_refusals(server, reference):
    """`exaggeration` / `cfg_weight` reach T3 (the SSE usage counts the package's tokens
    with them and without); bad values and voices are 400s naming the field."""
    text, seed, exaggeration, cfg_weight = EXTENDED
    body = {"input": text, "seed": seed, "max_tokens": TOKENS, "response_format": "pcm", "stream_format": "sse",
            "temperature": DEFAULTS["temperature"], "repetition_penalty": DEFAULTS["repetition_penalty"]}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        with_ext = await client.post("/v1/audio/speech", json={**body, "exaggeration": exaggeration,
                                                               "cfg_weight": cfg_weight})
        plain = await client.post("/v1/audio/speech", json=body)
        bad = [await client.post("/v1/audio/speech", json={**body, **field})
               for field in ({"exaggeration": 2.5}, {"cfg_weight": -1}, {"voice": "someone"})]
    for r, ref in ((with_ext, reference[4]), (plain, reference[5])):
        assert r.status_code == 200, r.text
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done"
        assert events[-1]["usage"]["output_tokens"] == len(ref["tokens"])
    assert reference[4]["tokens"].tolist() != reference[5]["tokens"].tolist()
    for r, param in zip(bad, ("exaggeration", "cfg_weight", "voice")):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    _clean(server)


def test_vocoder_equals_the_package(folder, reference):
    """S3Gen's HiFT (codecs/s3gen_hift.py) on the package's flow output, from its RNG state:
    the package's vocoder output within 1e-6 (float32)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from services.gpu_worker.codecs.s3gen_hift import HiFT

    ref = reference[7]
    s3gen = json.loads((folder / "config.json").read_text())["s3gen"]
    hift = HiFT(s3gen.get("HiFTGenerator"), s3gen.get("ConvRNNF0Predictor")).eval()
    state = load_file(str(folder / "s3gen.safetensors"))
    hift.load_state_dict({k[len("mel2wav."):]: v for k, v in state.items() if k.startswith("mel2wav.")})
    gen = torch.Generator()
    gen.set_state(torch.from_numpy(ref["rng"]))
    with torch.inference_mode():
        wave = hift(torch.from_numpy(ref["mel"]), gen).numpy()
    assert wave.shape == ref["hift"].shape and np.abs(ref["hift"]).max() > 0.01
    np.testing.assert_allclose(wave, ref["hift"], atol=1e-6, rtol=0)
