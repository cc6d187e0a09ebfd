"""Whisper through `mstar serve`: /v1/audio/transcriptions (json, text, verbose_json,
stream; also with the official openai client) and multipart /generate give the tokens
transformers' `WhisperForConditionalGeneration.generate` gives greedily for the same audio
(features by transformers' WhisperFeatureExtractor, the decoder prompt WhisperSpec's
forced ids, with the language transformers' `detect_language` picks when none is sent,
the checkpoint's suppress lists applied by generate from its generation config), and
verbose_json names the detected language; bad audio is a 400 that names the problem; a
form over the body limit is a 413. The server runs with MSTAR_KV_DEBUG_ASSERTS=1."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import openai
import pytest

from shared.specs.whisper import WhisperSpec
from tests.servers import MstarServer
from tests.whisper_checkpoints import make_whisper_checkpoint, sine_sweep, wav_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sf = pytest.importorskip("soundfile")

SR = 16000
MAX_TOKENS = 24
#: name -> (seconds, container, f0): 16 kHz clips, so transformers' extractor needs no resampling
CLIPS = {"sweep3s.wav": (3.0, "WAV", 150.0), "sweep2s.flac": (2.0, "FLAC", 400.0)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_whisper_checkpoint(tmp_path_factory.mktemp("whisper-e2e") / "tiny-whisper")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    s = MstarServer(str(ckpt), tmp_path_factory.mktemp("logs") / "whisper.log", "--num-kv-pages", "64",
                    "--page-size", "16", env={"MSTAR_KV_DEBUG_ASSERTS": "1"})
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("clips")
    out = {}
    for i, (name, (secs, fmt, f0)) in enumerate(CLIPS.items()):
        data = wav_bytes(sine_sweep(secs, sr=SR, f0=f0, seed=i), SR, fmt)
        (folder / name).write_bytes(data)
        out[name] = data
    return out


class Reference:
    """transformers' greedy Whisper and the checkpoint's tokenizer."""

    def __init__(self, ckpt) -> None:
        self.hf = transformers.WhisperForConditionalGeneration.from_pretrained(ckpt).eval()
        self.fe = transformers.WhisperFeatureExtractor.from_pretrained(ckpt)
        self.spec = WhisperSpec.from_folder(ckpt, page_size=16)
        self.tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"))
        self._memo: dict[tuple, list[int]] = {}

    def features(self, audio: bytes):
        samples, sr = sf.read(io.BytesIO(audio), dtype="float32")
        assert sr == self.fe.sampling_rate
        return self.fe(samples, sampling_rate=sr, return_tensors="pt").input_features

    def language(self, audio: bytes) -> str:
        """What transformers' `detect_language` picks (this checkpoint names no default)."""
        with torch.no_grad():
            (lang,) = self.hf.detect_language(self.features(audio)).tolist()
        return self.spec.language_code(lang)

    def tokens(self, audio: bytes, max_new_tokens: int = MAX_TOKENS, language: str | None = None) -> list[int]:
        """Greedy tokens after the forced prompt; no language: the detected one's."""
        key = (audio, max_new_tokens, language)
        if key not in self._memo:
            feats = self.features(audio)
            forced = self.spec.forced_ids(language or self.language(audio))
            with torch.no_grad():
                out = self.hf.generate(feats, decoder_input_ids=torch.tensor([forced]), do_sample=False,
                                       max_new_tokens=max_new_tokens)[0].tolist()
            if out[: len(forced)] == forced:  # transformers' Whisper returns only new tokens; be robust
                out = out[len(forced) :]
            self._memo[key] = out
        return self._memo[key]

    def text(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def ref(ckpt) -> Reference:
    return Reference(ckpt)


def transcribe(server, audio: bytes, filename: str = "clip.wav", **fields) -> httpx.Response:
    data = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}
    return httpx.post(server.url + "/v1/audio/transcriptions", files={"file": (filename, audio)}, data=data,
                      timeout=120)


def sse_events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return [json.loads(block[len("data: "):]) for block in r.text.split("\n\n") if block]


# ---- transcriptions: tokens equal transformers' ------------------------------------------


@pytest.mark.parametrize("name", list(CLIPS))
def test_verbose_json_tokens_equal_transformers(server, clips, ref, name):
    audio = clips[name]
    want = ref.tokens(audio)
    r = transcribe(server, audio, name, response_format="verbose_json", max_tokens=MAX_TOKENS)
    assert r.status_code == 200, r.text
    body = r.json()
    (segment,) = body["segments"]
    assert segment["tokens"] == want
    assert body["text"] == segment["text"] == ref.text(want)
    assert body["task"] == "transcribe" and body["language"] == ref.language(audio)  # detected, as transformers
    assert body["duration"] == pytest.approx(CLIPS[name][0]) and segment["end"] == body["duration"]
    assert segment["id"] == 0 and segment["start"] == 0.0 and segment["temperature"] == 0.0


@pytest.mark.parametrize("name", list(CLIPS))
def test_json_and_text_equal_transformers(server, clips, ref, name):
    audio = clips[name]
    want_text = ref.text(ref.tokens(audio))
    r = transcribe(server, audio, name, max_tokens=MAX_TOKENS)  # response_format json is the default
    assert r.status_code == 200, r.text
    assert r.json() == {"text": want_text}
    r = transcribe(server, audio, name, response_format="text", max_tokens=MAX_TOKENS)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == want_text


@pytest.mark.parametrize("name", list(CLIPS))
def test_stream_deltas_join_to_the_text(server, clips, ref, name):
    audio = clips[name]
    want_text = ref.text(ref.tokens(audio))
    events = sse_events(transcribe(server, audio, name, stream=True, max_tokens=MAX_TOKENS))
    assert events[-1] == {"type": "transcript.text.done", "text": want_text}
    deltas = events[:-1]
    assert deltas and all(e["type"] == "transcript.text.delta" and e["delta"] for e in deltas)
    assert "".join(e["delta"] for e in deltas) == want_text


def test_default_max_tokens_runs_to_the_decoder_window(server, clips, ref):
    """No max_tokens: the most the decoder's 64 positions allow after the forced prompt."""
    audio = clips["sweep3s.wav"]
    window = ref.spec.max_seq_len - len(ref.spec.forced_ids())
    want = ref.tokens(audio, max_new_tokens=window)
    r = transcribe(server, audio, response_format="verbose_json")
    assert r.status_code == 200, r.text
    assert r.json()["segments"][0]["tokens"] == want


def test_language_forces_its_token(server, clips, ref):
    audio = clips["sweep3s.wav"]
    want = ref.tokens(audio, language="de")
    assert want != ref.tokens(audio)  # the forced language token changes what the decoder says
    r = transcribe(server, audio, response_format="verbose_json", language="de", max_tokens=MAX_TOKENS)
    assert r.status_code == 200, r.text
    assert r.json()["segments"][0]["tokens"] == want and r.json()["language"] == "de"
    r = transcribe(server, audio, language="xx")
    assert r.status_code == 400 and r.json()["error"]["param"] == "language"
    assert "'xx' is not supported" in r.json()["error"]["message"]


# ---- multipart /generate ------------------------------------------------------------------


def test_generate_with_a_file(server, clips, ref):
    audio = clips["sweep2s.flac"]
    want = ref.tokens(audio)
    files = {"file": ("clip.flac", audio)}
    data = {"max_tokens": str(MAX_TOKENS), "temperature": "0", "request_id": "audio-gen-1"}
    r = httpx.post(server.url + "/generate", files=files, data=data, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "audio-gen-1" and body["token_ids"] == want and body["text"] == ref.text(want)
    assert body["finish_reason"] == ("stop" if want[-1] in ref.spec.eos_token_ids else "length")
    assert body["usage"] == {"prompt_tokens": len(ref.spec.forced_ids()), "completion_tokens": len(want)}
    with httpx.stream("POST", server.url + "/generate", files=files,
                      data={**data, "stream": "true", "request_id": "audio-gen-2"}, timeout=120) as r:
        r.read()
    events = sse_events(r)
    assert events[-1]["type"] == "done" and events[-1]["token_ids"] == want
    assert [t for e in events[:-1] for t in e["token_ids"]] == want
    assert "".join(e["text"] for e in events[:-1]) == events[-1]["text"] == body["text"]


def test_generate_without_a_file_is_refused(server):
    r = httpx.post(server.url + "/generate", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(server.url + "/generate", files={"file": ("a.wav", b"")}, data={"prompt": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---- bad audio ------------------------------------------------------------------------------


def test_random_bytes_are_a_400(server):
    noise = np.random.default_rng(0).bytes(4096)
    for path in ("/v1/audio/transcriptions", "/generate"):
        r = httpx.post(server.url + path, files={"file": ("clip.wav", noise)}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "file" and "could not be decoded" in err["message"], err


def test_too_long_clip_is_a_400_naming_its_length(server):
    # 45 s at 8 kHz 16-bit: 720 kB, under the default 1 MiB body limit, so the data worker sees it
    audio = wav_bytes(sine_sweep(45.0, sr=8000, f1=3000.0), 8000, "WAV", "PCM_16")
    r = transcribe(server, audio)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "file" and "45.00 s" in err["message"] and "30 s" in err["message"], err


def test_form_over_the_body_limit_is_a_413(server):
    audio = wav_bytes(sine_sweep(40.0, sr=SR), SR, "WAV", "PCM_16")  # 1.28 MB > 1 MiB
    r = transcribe(server, audio)
    assert r.status_code == 413 and "request body exceeds" in r.json()["error"]["message"]


def test_empty_file_and_prompt_refused(server, clips):
    r = transcribe(server, b"")
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = transcribe(server, clips["sweep3s.wav"], prompt="previous words")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---- the openai client ----------------------------------------------------------------------


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_openai_client(client, ckpt, clips, ref, tmp_path):
    path = tmp_path / "sweep3s.wav"
    path.write_bytes(clips["sweep3s.wav"])
    window = ref.spec.max_seq_len - len(ref.spec.forced_ids())
    want = ref.tokens(clips["sweep3s.wav"], max_new_tokens=window)
    with open(path, "rb") as f:
        out = client.audio.transcriptions.create(model=ckpt.name, file=f)
    assert out.text == ref.text(want)
    with open(path, "rb") as f:
        verbose = client.audio.transcriptions.create(model=ckpt.name, file=f, response_format="verbose_json",
                                                     extra_body={"max_tokens": MAX_TOKENS})
    assert verbose.segments[0].tokens == ref.tokens(clips["sweep3s.wav"]) and verbose.duration == pytest.approx(3.0)
    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model=ckpt.name, file=f, response_format="text")
    assert text == ref.text(want)
    with open(path, "rb") as f:
        events = list(client.audio.transcriptions.create(model=ckpt.name, file=f, stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == ref.text(want)
    assert "".join(e.delta for e in events[:-1]) == events[-1].text


def test_openai_client_errors(client, ckpt, clips, tmp_path):
    path = tmp_path / "sweep3s.wav"
    path.write_bytes(clips["sweep3s.wav"])
    with open(path, "rb") as f, pytest.raises(openai.NotFoundError) as info:
        client.audio.transcriptions.create(model="whisper-1", file=f)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model=ckpt.name, file=("noise.wav", b"\x00" * 100))
    assert info.value.param == "file"


# ---- a text model ---------------------------------------------------------------------------


def test_text_model_refuses_audio(llama_server, clips):
    for path in ("/v1/audio/transcriptions", "/generate"):
        r = httpx.post(llama_server.url + path, files={"file": ("clip.wav", clips["sweep3s.wav"])}, timeout=60)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "the served model does not take audio"
        assert r.json()["error"]["param"] == "file"


def test_server_log_clean(server):
    """No tracebacks from any service for all of the above; under debug asserts no
    footprint was overrun or loose (the language probes' scratch included), and every
    page came back."""
    log = server.log()
    assert "Traceback" not in log, log[-4000:]
    assert "footprint not tight" not in log and "footprint overrun" not in log, log[-4000:]
    assert server.metric("mstar_kv_footprint_overruns_total") == 0
    assert server.wait_pages_free() == 0
