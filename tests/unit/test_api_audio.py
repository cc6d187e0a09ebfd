"""Audio at the api, in process and without peers: multipart form parsing, the audio
fields' validation (the same checks and messages as JSON), the "not a speech model"
refusal, and the replies of /v1/audio/transcriptions and multipart /generate.

Refusals happen before anything is submitted, so the real backend is fine for them. The
reply shapes use a scripted backend that answers `submit` with canned outputs and keeps
the `GenerateRequest` it was given, so the tests also see exactly what would go to the
data worker."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from services.api.app import create_app
from services.api.backend import Backend, RequestHandle
from services.api.errors import ApiError
from services.api.forms import MAX_FORM_PARTS, parse_form, typed_value
from services.api.settings import ApiSettings
from services.api.state import ApiState
from services.api.transcription import audio_duration, is_speech_model, language_code, parse_transcription
from services.api.validation import parse_audio_generate, parse_generate
from shared.errors import ErrorKind
from shared.frames import GenerateRequest, Output, RequestError
from tests.unit.test_api_validation import tiny_tokenizer
from tests.whisper_checkpoints import make_whisper_tokenizer

MODEL = "tiny-whisper"
SR = 16000


def wav(seconds: float = 0.25, sr: int = SR) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * sr)) / sr
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


WAV = wav()


def multipart(fields: dict | list | None = None, file: bytes | None = WAV,
              filename: str | None = "clip.wav") -> tuple[bytes, str]:
    """(body, content type) as httpx (and so the openai client) encodes a form; with no
    file too (httpx would send that urlencoded)."""
    files = None if file is None else {"file": (filename, file, "audio/wav")}
    if isinstance(fields, list):  # repeated names: httpx takes them as a list value
        grouped: dict[str, list[str]] = {}
        for name, value in fields:
            grouped.setdefault(name, []).append(value)
        fields = grouped
    if files is None:
        files = {"_drop": ("x", b"")}  # makes httpx write multipart; removed below
        req = httpx.Request("POST", "http://x/", data=fields or {}, files=files)
        body, ctype = req.read(), req.headers["content-type"]
        boundary = ctype.split("boundary=")[1].encode()
        parts = body.split(b"--" + boundary)
        kept = [p for p in parts if b'name="_drop"' not in p]
        return (b"--" + boundary).join(kept), ctype
    req = httpx.Request("POST", "http://x/", data=fields or {}, files=files)  # filename None: no filename
    return req.read(), req.headers["content-type"]


def parsed(fields: dict | None = None, **kw):
    body, ctype = multipart(fields, **kw)
    return parse_form(body, ctype)


def refused_form(body: bytes, ctype: str | None) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_form(body, ctype)
    return info.value


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


# ---- forms.py -------------------------------------------------------------------------


def test_form_values_are_typed_as_json_would_be() -> None:
    f = parsed({"max_tokens": "5", "temperature": "0.5", "top_k": "-1", "seed": "42", "stream": "true",
                "ignore_eos": "false", "request_id": "123", "language": "en", "task": "transcribe", "top_p": "null"})
    assert f.file == WAV
    assert f.fields == {"max_tokens": 5, "temperature": 0.5, "top_k": -1, "seed": 42, "stream": True,
                        "ignore_eos": False, "request_id": "123", "language": "en", "task": "transcribe", "top_p": None}
    assert type(f.fields["temperature"]) is float and type(f.fields["max_tokens"]) is int


@pytest.mark.parametrize(("name", "value", "want"), [
    ("max_tokens", "abc", "abc"),  # not JSON: kept as text, for the validator to refuse
    ("max_tokens", "5.0", 5.0),  # a float, refused as in JSON
    ("temperature", "1e400", "1e400"),  # out of range: kept as text
    ("temperature", "NaN", "NaN"),
    ("seed", " 7 ", 7),
    ("max_tokens", "", None),  # empty = not given
    ("prompt", "", None),
    ("prompt", "5", "5"),  # text fields are never read as JSON
    ("stop", "true", "true"),
    ("language", "null", "null"),
])
def test_typed_value(name: str, value: str, want: object) -> None:
    got = typed_value(name, value)
    assert got == want and type(got) is type(want)


def test_stop_may_repeat_other_fields_may_not() -> None:
    assert parsed([("stop", "a"), ("stop", "b")]).fields == {"stop": ["a", "b"]}
    assert parsed([("stop", "a")]).fields == {"stop": "a"}
    err = refused_form(*multipart([("max_tokens", "1"), ("max_tokens", "2")]))
    assert (err.status, err.param, err.message) == (
        400, "max_tokens", "form field 'max_tokens' is given 2 times; give it once")


def test_file_part_with_or_without_filename() -> None:
    assert parsed(filename=None).file == WAV  # curl -F file=<clip.wav
    assert parsed(file=None).file is None
    assert parsed(file=b"").file == b""


def test_two_files_refused() -> None:
    req = httpx.Request("POST", "http://x/", files=[("file", ("a.wav", WAV)), ("file", ("b.wav", WAV))])
    err = refused_form(req.read(), req.headers["content-type"])
    assert (err.status, err.param) == (400, "file") and "more than one 'file' part" in err.message


def test_form_content_type_and_framing_refusals() -> None:
    body, ctype = multipart({"max_tokens": "3"})
    err = refused_form(body, "application/json")
    assert err.status == 400 and err.param == "file"
    assert err.message == "the body must be multipart/form-data with a 'file' part (Content-Type: application/json)"
    assert refused_form(body, None).message.endswith("(Content-Type: none)")
    assert refused_form(body, "multipart/form-data").message == "the multipart/form-data Content-Type has no boundary"
    assert refused_form(body[:-20], ctype).message == "the multipart/form-data body is incomplete (no closing boundary)"
    assert refused_form(b"", ctype).message == "the multipart/form-data body is incomplete (no closing boundary)"
    assert refused_form(b"garbage", ctype).message.startswith("the multipart/form-data body is malformed")
    assert parse_form(body, ctype.replace("multipart/form-data", "Multipart/Form-Data")).fields == {"max_tokens": 3}


def test_form_part_refusals() -> None:
    boundary = "xyz"
    ctype = f"multipart/form-data; boundary={boundary}"

    def body(*parts: tuple[bytes, bytes]) -> bytes:
        out = b"".join(b"--xyz\r\nContent-Disposition: " + d + b"\r\n\r\n" + v + b"\r\n" for d, v in parts)
        return out + b"--xyz--\r\n"

    assert parse_form(body((b'form-data; name="max_tokens"', b"4")), ctype).fields == {"max_tokens": 4}
    err = refused_form(body((b"form-data", b"4")), ctype)
    assert err.status == 400 and "has no name" in err.message
    err = refused_form(body((b'form-data; name="prompt"', b"\xff\xfe")), ctype)
    assert (err.status, err.param, err.message) == (400, "prompt", "form field 'prompt' is not valid UTF-8")
    many = body(*[(f'form-data; name="f{i}"'.encode(), b"1") for i in range(MAX_FORM_PARTS + 1)])
    assert refused_form(many, ctype).message == f"the form has more than {MAX_FORM_PARTS} parts"


# ---- parse_audio_generate (multipart /generate) -----------------------------------------


def test_audio_generate_defaults_and_fields() -> None:
    p = parse_audio_generate(parsed().fields, WAV)
    assert p.audio == WAV and p.prompt is None and p.input_ids is None and p.language is None and p.task is None
    assert p.request_id.startswith("gen-") and p.max_tokens is None and p.stream is None and p.stop == []
    assert p.sampling == parse_generate({"prompt": "x"}).sampling  # /generate's defaults (temperature 1)
    f = parsed({"max_tokens": "7", "temperature": "0", "top_p": "0.5", "top_k": "3", "seed": "9", "ignore_eos": "true",
                "stream": "true", "request_id": "r-1", "language": "<|de|>", "task": "translate", "stop": "x"}).fields
    p = parse_audio_generate(f, WAV)
    assert (p.max_tokens, p.stream, p.request_id, p.language, p.task, p.stop) == (
        7, True, "r-1", "<|de|>", "translate", ["x"])
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == (0.0, 0.5, 3, 9, True)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"prompt": "hi"}, "prompt",
     'prompt must be absent when an audio file is sent: the audio is the prompt, got "hi"'),
    ({"input_ids": "[1, 2]"}, "input_ids",
     "input_ids must be absent when an audio file is sent: the audio is the prompt, got [1,2]"),
    ({"max_tokens": "abc"}, "max_tokens", 'max_tokens must be an integer >= 1, got "abc"'),
    ({"max_tokens": "5.0"}, "max_tokens", "max_tokens must be an integer >= 1, got 5.0"),
    ({"max_tokens": "0"}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"temperature": "-1"}, "temperature", "temperature must be a number >= 0 (0 = greedy), got -1"),
    ({"temperature": "1e400"}, "temperature", 'temperature must be a number >= 0 (0 = greedy), got "1e400"'),
    ({"stream": "yes"}, "stream", 'stream must be a boolean, got "yes"'),
    ({"seed": "-1"}, "seed", "seed must be an integer in [0, 9223372036854775807], got -1"),
    ({"request_id": "a b"}, "request_id",
     'request_id must be a string of 1-128 characters from [A-Za-z0-9._:-], got "a b"'),
    ({"language": "e n"}, "language",
     'language must be a language code such as "en" (letters, "-" or "_", 1-32 characters), got "e n"'),
    ({"task": "summarize"}, "task", 'task must be "transcribe" or "translate", got "summarize"'),
    ({"n": "2"}, "n", "n > 1 is not supported; n must be 1, got 2"),
    ({"response_format": "json"}, "response_format", None),  # a transcription field: unknown here
    ({"bogus": "1"}, "bogus", None),
])
def test_audio_generate_refusals(fields: dict, param: str, message: str | None) -> None:
    err = refused(parse_audio_generate, parsed(fields).fields, WAV)
    assert (err.status, err.param) == (400, param)
    if message is not None:
        assert err.message == message


def test_audio_generate_messages_equal_json_ones() -> None:
    """A form field and a JSON field are checked by the same code, so the same message."""
    for name, value in [("max_tokens", "abc"), ("temperature", "-1"), ("top_p", "2"), ("top_k", "-2"), ("seed", "1.5")]:
        form_err = refused(parse_audio_generate, {name: typed_value(name, value)}, WAV)
        json_err = refused(parse_generate, {"prompt": "x", name: typed_value(name, value)})
        assert (form_err.message, form_err.param) == (json_err.message, json_err.param)
    form_err = refused(parse_audio_generate, {"stop": ["a", ""]}, WAV)
    assert form_err.message == refused(parse_generate, {"prompt": "x", "stop": ["a", ""]}).message
    form_err = refused(parse_audio_generate, {"bogus": 1}, WAV)
    assert form_err.message.startswith("unknown field 'bogus'; allowed fields: ") and "language" in form_err.message


def test_audio_generate_file_required_and_non_empty() -> None:
    err = refused(parse_audio_generate, {}, None)
    assert (err.status, err.param) == (400, "file") and err.message.startswith("file is required")
    err = refused(parse_audio_generate, {}, b"")
    assert (err.status, err.param, err.message) == (400, "file", "file is empty; upload a WAV or FLAC file")


# ---- parse_transcription --------------------------------------------------------------


def test_transcription_defaults() -> None:
    req = parse_transcription({}, WAV, MODEL)
    p = req.params
    assert (req.response_format, req.stream) == ("json", False)
    assert p.request_id.startswith("trsc-") and p.audio == WAV and p.task == "transcribe" and p.language is None
    assert p.sampling.temperature == 0.0 and p.sampling.greedy and p.max_tokens is None


def test_transcription_fields() -> None:
    f = parsed({"model": MODEL, "language": "de", "prompt": "", "response_format": "text", "temperature": "0.7",
                "stream": "true", "max_tokens": "9", "ignore_eos": "true", "seed": "3"}).fields
    req = parse_transcription(f, WAV, MODEL)
    p = req.params
    assert (req.response_format, req.stream, p.language, p.max_tokens) == ("text", True, "de", 9)
    assert (p.sampling.temperature, p.sampling.ignore_eos, p.sampling.seed) == (0.7, True, 3)


@pytest.mark.parametrize(("fields", "status", "param", "message"), [
    ({"model": "whisper-1"}, 404, "model", "The model `whisper-1` does not exist; this server serves `tiny-whisper`."),
    ({"prompt": "earlier text"}, 400, "prompt",
     'prompt must be left out or empty (no conditioning on previous text), got "earlier text"'),
    ({"response_format": "srt"}, 400, "response_format",
     'response_format must be one of json, text, verbose_json (no timestamps: not srt, vtt or diarized_json), '
     'got "srt"'),
    ({"response_format": "vtt"}, 400, "response_format", None),
    ({"response_format": "xml"}, 400, "response_format",
     'response_format must be one of json, text, verbose_json (no timestamps: not srt, vtt or diarized_json), '
     'got "xml"'),
    ({"response_format": "verbose_json", "stream": "true"}, 400, "stream",
     "stream is not supported with response_format verbose_json; use json or text"),
    ({"temperature": "hot"}, 400, "temperature", 'temperature must be a number >= 0 (0 = greedy), got "hot"'),
    ({"max_tokens": "0"}, 400, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"stream": "1"}, 400, "stream", "stream must be a boolean, got 1"),
    ({"language": "<|e n|>"}, 400, "language", None),
    ({"top_p": "0.5"}, 400, "top_p", None),  # not a transcription field
    ({"timestamp_granularities[]": "segment"}, 400, "timestamp_granularities[]", None),
    ({"task": "translate"}, 400, "task", None),  # transcriptions only transcribe
])
def test_transcription_refusals(fields: dict, status: int, param: str, message: str | None) -> None:
    err = refused(parse_transcription, parsed(fields).fields, WAV, MODEL)
    assert (err.status, err.param) == (status, param), err.message
    if message is not None:
        assert err.message == message
    if status == 404:
        assert err.code == "model_not_found"


def test_transcription_file_refusals() -> None:
    assert refused(parse_transcription, {}, None, MODEL).param == "file"
    assert refused(parse_transcription, {}, b"", MODEL).message == "file is empty; upload a WAV or FLAC file"


# ---- helpers of transcription.py --------------------------------------------------------


def test_speech_model_detection() -> None:
    assert is_speech_model({"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"})
    assert is_speech_model({"model_type": "whisper"})
    assert not is_speech_model({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert not is_speech_model({})


def test_language_code_and_duration() -> None:
    assert [language_code(x) for x in ("en", "EN", "<|de|>")] == ["en", "en", "de"]
    assert audio_duration(wav(1.5)) == pytest.approx(1.5)
    assert audio_duration(b"not audio") is None


# ---- routes -------------------------------------------------------------------------


def make_settings(tmp_path, **kw) -> ApiSettings:
    def addr(name: str) -> str:
        return f"ipc://{tmp_path}/{name}.sock"

    values = dict(model_name=MODEL, api_addr=addr("api"), advertise_addr=addr("api"), data_worker_addr=addr("dw"),
                  conductor_addr=addr("c"), control_addr=addr("cc"), max_body_bytes=64 * 1024, status_timeout_s=0.2)
    values.update(kw)
    return ApiSettings(**values)


def post_form(client: TestClient, path: str, fields: dict | list | None = None, file: bytes | None = WAV, **kw):
    body, ctype = multipart(fields, file=file, **kw)
    return client.post(path, content=body, headers={"content-type": ctype})


@pytest.fixture()
def text_client(tmp_path):
    """A server for a text model: the audio routes refuse."""
    with TestClient(create_app(make_settings(tmp_path), tiny_tokenizer())) as c:
        yield c


@pytest.fixture()
def speech_client(tmp_path):
    """A speech model's api with the real (unanswered) backend: for refusals only."""
    with TestClient(create_app(make_settings(tmp_path, takes_audio=True, audio_language="en", max_body_bytes=16384),
                               tiny_tokenizer())) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/generate"])
def test_text_model_refuses_audio(text_client: TestClient, path: str) -> None:
    r = post_form(text_client, path, {"max_tokens": "3"})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "the served model does not take audio", "type": "invalid_request_error",
                                 "param": "file", "error_id": None, "code": None}


def test_json_generate_unchanged(text_client: TestClient) -> None:
    r = text_client.post("/generate", json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = text_client.post("/generate", json={"prompt": "x", "language": "en"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "language"  # unknown in JSON


def test_speech_route_refusals(speech_client: TestClient) -> None:
    c = speech_client
    r = c.post("/v1/audio/transcriptions", json={"file": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = post_form(c, "/v1/audio/transcriptions", {"model": MODEL}, file=None)
    assert (r.status_code == 400 and r.json()["error"]["param"] == "file"
            and "file is required" in r.json()["error"]["message"])
    r = post_form(c, "/generate", {"max_tokens": "2"}, file=b"")
    assert r.status_code == 400 and r.json()["error"]["message"] == "file is empty; upload a WAV or FLAC file"
    r = post_form(c, "/generate", {"prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post_form(c, "/v1/audio/transcriptions", {"model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/generate"])
def test_form_over_the_body_limit_is_413(speech_client: TestClient, path: str) -> None:
    r = post_form(speech_client, path, file=wav(1.0))  # 32 kB of samples > 16384 bytes
    assert r.status_code == 413
    assert r.json()["error"]["message"] == "request body exceeds 16384 bytes"


# ---- replies, with a scripted backend -------------------------------------------------


class ScriptedBackend(Backend):
    """Answers every submit with `script(req)`'s outputs; keeps what it was sent."""

    def __init__(self, script) -> None:
        super().__init__(api_addr="inproc://x", reply_to="inproc://x", data_worker_addr="inproc://d",
                         conductor_addr="inproc://c", control_addr="inproc://cc")
        self.script = script
        self.sent: list[GenerateRequest] = []
        self.aborted: list[str] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def submit(self, req: GenerateRequest) -> RequestHandle:
        self.sent.append(req)
        handle = RequestHandle(req.request_id, self)
        for item in self.script(req):
            handle.put(item)
        return handle

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted.append(request_id)


@pytest.fixture(scope="module")
def whisper_tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    make_whisper_tokenizer(path)
    return Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture()
def scripted(tmp_path, whisper_tok):
    """(client, backend, ids, text): the model 'says' ids in three frames, then EOS."""
    eot = whisper_tok.token_to_id("<|endoftext|>")
    ids = whisper_tok.encode("the quick brown fox").ids
    chunks = [ids[:1], ids[1:3], ids[3:]]

    def script(req: GenerateRequest):
        outs = [Output(req.request_id, c, prompt_tokens=4) for c in chunks]
        outs.append(Output(req.request_id, [eot], "stop", prompt_tokens=4))
        return outs

    backend = ScriptedBackend(script)
    settings = make_settings(tmp_path, takes_audio=True, audio_language="en")
    state = ApiState(settings, whisper_tok, backend=backend)
    with TestClient(create_app(settings, whisper_tok, state=state)) as c:
        yield c, backend, [*ids, eot], whisper_tok.decode(ids)


def test_transcription_json(scripted) -> None:
    c, backend, _ids, text = scripted
    r = post_form(c, "/v1/audio/transcriptions", {"model": MODEL, "language": "DE", "max_tokens": "20", "seed": "5"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"text": text}
    (req,) = backend.sent
    assert req.audio == WAV and req.language == "DE" and req.task == "transcribe" and req.prompt is None
    assert req.input_ids is None and req.max_tokens == 20 and req.model == MODEL
    assert req.sampling.temperature == 0.0 and req.sampling.seed == 5 and req.request_id.startswith("trsc-")


def test_transcription_text(scripted) -> None:
    c, _, _, text = scripted
    r = post_form(c, "/v1/audio/transcriptions", {"response_format": "text"})
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; charset=utf-8"
    assert r.text == text


def test_transcription_verbose_json(scripted) -> None:
    c, _, ids, text = scripted
    clip = wav(0.75)
    r = post_form(c, "/v1/audio/transcriptions", {"response_format": "verbose_json", "temperature": "0"}, file=clip)
    assert r.status_code == 200
    body = r.json()
    assert body == {"task": "transcribe", "language": "en", "duration": 0.75, "text": text, "segments": [
        {"id": 0, "seek": 0, "start": 0.0, "end": 0.75, "text": text, "tokens": ids, "temperature": 0.0}]}
    r = post_form(c, "/v1/audio/transcriptions", {"response_format": "verbose_json", "language": "<|DE|>"}, file=clip)
    assert r.json()["language"] == "de"


def sse(r: httpx.Response) -> list[dict]:
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            events.append(json.loads(block[len("data: "):]))
    return events


@pytest.mark.parametrize("response_format", [None, "json", "text"])
def test_transcription_stream(scripted, response_format) -> None:
    c, _, _, text = scripted
    fields = {"stream": "true"} | ({"response_format": response_format} if response_format else {})
    body, ctype = multipart(fields)
    with c.stream("POST", "/v1/audio/transcriptions", content=body, headers={"content-type": ctype}) as r:
        r.read()
    events = sse(r)
    assert [e["type"] for e in events] == ["transcript.text.delta"] * (len(events) - 1) + ["transcript.text.done"]
    deltas = [e["delta"] for e in events[:-1]]
    assert all(deltas) and len(deltas) >= 2  # several frames, no empty delta sent
    assert "".join(deltas) == text == events[-1]["text"]
    assert set(events[-1]) == {"type", "text"}


def test_generate_form_reply_equals_json_shape(scripted) -> None:
    c, backend, ids, text = scripted
    r = post_form(c, "/generate", {"max_tokens": "10", "temperature": "0", "language": "fr", "task": "translate",
                                   "request_id": "audio-1"})
    assert r.status_code == 200
    assert r.json() == {"id": "audio-1", "text": text, "token_ids": ids, "finish_reason": "stop",
                        "usage": {"prompt_tokens": 4, "completion_tokens": len(ids)}}
    req = backend.sent[-1]
    assert (req.audio, req.language, req.task, req.max_tokens, req.request_id) == (
        WAV, "fr", "translate", 10, "audio-1")
    json_r = c.post("/generate", json={"prompt": "hello", "request_id": "text-1"})
    assert set(json_r.json()) == set(r.json())  # the same reply object for both bodies


def test_generate_form_stream(scripted) -> None:
    c, _, _ids, text = scripted
    body, ctype = multipart({"stream": "true", "stop": "brown"})
    with c.stream("POST", "/generate", content=body, headers={"content-type": ctype}) as r:
        r.read()
    events = sse(r)
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "stop"
    assert "".join(e["text"] for e in events[:-1]) == events[-1]["text"] == text[: text.index("brown")]


def test_data_worker_refusal_passes_through(tmp_path, whisper_tok) -> None:
    """The data worker's audio refusal (a RequestError) is the client's 400, JSON or SSE."""
    message = "audio could not be decoded; send a WAV or FLAC file"
    backend = ScriptedBackend(lambda req: [RequestError(req.request_id, ErrorKind.INVALID, message, param="file")])
    settings = make_settings(tmp_path, takes_audio=True)
    with TestClient(create_app(settings, whisper_tok, state=ApiState(settings, whisper_tok, backend=backend))) as c:
        for fields in ({}, {"stream": "true"}):
            r = post_form(c, "/v1/audio/transcriptions", fields, file=b"\x00garbage")
            assert r.status_code == 400
            assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": "file",
                                         "error_id": None, "code": None}
            r = post_form(c, "/generate", fields, file=b"\x00garbage")
            assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_verbose_json_language_is_the_one_the_worker_reports(tmp_path, whisper_tok) -> None:
    """A request without a language on a model that detects it: the worker reports the
    detected language with the first output (`Output.metadata`), and verbose_json says it,
    not the api's idea of a default. A text reply and the stream are unchanged."""
    eot = whisper_tok.token_to_id("<|endoftext|>")
    ids = whisper_tok.encode("the quick").ids

    def script(req: GenerateRequest):
        return [Output(req.request_id, ids, prompt_tokens=4, metadata={"language": "ko"}),
                Output(req.request_id, [eot], "stop", prompt_tokens=4)]

    settings = make_settings(tmp_path, takes_audio=True, audio_language=None)
    state = ApiState(settings, whisper_tok, backend=ScriptedBackend(script))
    with TestClient(create_app(settings, whisper_tok, state=state)) as c:
        r = post_form(c, "/v1/audio/transcriptions", {"response_format": "verbose_json"})
        assert r.status_code == 200 and r.json()["language"] == "ko"
        assert post_form(c, "/v1/audio/transcriptions", {}).json() == {"text": whisper_tok.decode(ids)}
        r = post_form(c, "/generate", {"max_tokens": "5"})  # /generate's reply object keeps its shape
        assert set(r.json()) == {"id", "text", "token_ids", "finish_reason", "usage"}


@pytest.mark.parametrize(("fmt", "snr_db"), [("flac", 80.0), ("mp3", 25.0), ("opus", 10.0)])
def test_speech_formats_through_soundfile_decode_to_the_clip(fmt: str, snr_db: float) -> None:
    """flac holds the clip's 16-bit samples exactly; mp3 and opus (lossy) decode to the same
    rate and length, close to it (a chirp at 24 kHz, SNAC's and Mimi's rate)."""
    from services.api.speech import FORMATS, encode_audio

    t = np.arange(48000) / 24000
    clip = (0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t)).astype(np.float32)
    encoded = encode_audio(clip, fmt, 24000)
    got, rate = sf.read(io.BytesIO(encoded), dtype="float32")
    assert rate == 24000 and len(got) == len(clip) and fmt in FORMATS
    want = np.frombuffer(encode_audio(clip, "pcm", 24000), "<i2") / 32768
    assert 10 * np.log10(np.sum(want**2) / np.sum((got - want) ** 2)) > snr_db


def test_max_audio_seconds_is_whole_frames_of_the_models_codec():
    """Orpheus: SNAC frames of 2,048 samples at 24 kHz (11.72 a second), 7 tokens each; CSM:
    Mimi's 12.5 frames a second, one token each; the smaller cap with max_tokens."""
    import msgspec

    from services.api.schemas import SpeechRequest
    from services.api.speech import token_cap
    from shared.specs.orpheus import OrpheusSpec

    orpheus = OrpheusSpec({"vocab_size": 200, "hidden_size": 8, "num_attention_heads": 1, "num_hidden_layers": 1},
                          page_size=16)
    assert (orpheus.audio_frame_rate, orpheus.audio_frame_tokens) == (24000 / 2048, 7)

    def cap(rate: float, tokens: int, **body) -> int | None:
        return token_cap(msgspec.convert({"input": "x", **body}, SpeechRequest), rate, tokens)

    assert cap(24000 / 2048, 7, max_audio_seconds=1.0) == 12 * 7  # 11.72 frames, rounded up
    assert cap(24000 / 2048, 7, max_audio_seconds=1.0, max_tokens=50) == 50
    assert cap(12.5, 1, max_audio_seconds=0.4) == 5 and cap(12.5, 1, max_audio_seconds=0.41) == 6
    assert cap(12.5, 1, max_tokens=9) == 9 and cap(12.5, 1) is None
    assert cap(12.5, 1, max_audio_seconds=0.4, max_tokens=3) == 3
