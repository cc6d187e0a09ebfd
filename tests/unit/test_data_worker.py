"""The data worker keeps only layout-free copies of what it sent, and uses them: an abort
it forwards is logged with the request's sizes, and the copy is dropped. Every request,
audio too, goes through the spec's `process_prompt`, whose metadata reaches the engine."""

from __future__ import annotations

import logging

import numpy as np
import zmq
import zmq.asyncio

from services.data_worker.data_worker import DataWorker
from shared.audio import audio_features
from shared.errors import ErrorKind
from shared.frames import (
    Abort,
    FrameCodec,
    GenerateRequest,
    NewRequest,
    RequestError,
    SamplingParams,
    ToApi,
    ToConductor,
    unpack_tensors,
)
from shared.model_source import ModelSource
from tests.whisper_checkpoints import sine_sweep, wav_bytes, whisper_ckpt  # noqa: F401  (fixture)


async def test_sent_requests_are_kept_without_layouts_and_used_on_abort(tmp_path, caplog):
    source = ModelSource("null")
    addrs = {"data_worker": f"ipc://{tmp_path}/dw.sock", "conductor": f"ipc://{tmp_path}/c.sock"}
    ctx = zmq.asyncio.Context()
    conductor = ctx.socket(zmq.PULL)
    conductor.bind(addrs["conductor"])
    dw = DataWorker(source.spec(16), source.tokenizer, addrs)
    try:
        req = GenerateRequest("r1", "null", SamplingParams(), f"ipc://{tmp_path}/api.sock", max_tokens=7,
                              input_ids=[72, 105, 33])
        await dw._handle(req)
        sent, _ = FrameCodec(ToConductor).decode(await conductor.recv_multipart())
        assert isinstance(sent, NewRequest) and sent.kv_layout  # the layouts went on the wire...
        kept = dw.recent["r1"]
        assert kept.kv_layout == {} and (kept.prompt_len, kept.max_tokens) == (3, 7)  # ...and nowhere else
        with caplog.at_level(logging.INFO, logger="mstar.data_worker"):
            assert dw._note_abort(Abort("r1", "client_disconnect")) is kept
        assert "r1" not in dw.recent
        assert "abort of r1 (client_disconnect) forwarded: prompt 3 tokens, max_tokens 7" in caplog.text
        assert dw._note_abort(Abort("r1")) is None  # already forgotten
    finally:
        conductor.close(0)
        dw.pushers.close()
        dw.ctx.destroy(0)
        ctx.destroy(0)


class _Sink:
    """A data worker wired to a PULL socket standing in for the conductor (and the api)."""

    def __init__(self, tmp_path, source) -> None:
        self.addrs = {"data_worker": f"ipc://{tmp_path}/dw.sock", "conductor": f"ipc://{tmp_path}/c.sock"}
        self.reply_to = f"ipc://{tmp_path}/api.sock"
        self.ctx = zmq.asyncio.Context()
        self.conductor = self.ctx.socket(zmq.PULL)
        self.conductor.bind(self.addrs["conductor"])
        self.api = self.ctx.socket(zmq.PULL)
        self.api.bind(self.reply_to)
        self.dw = DataWorker(source.spec(16), source.tokenizer, self.addrs)

    async def send(self, **fields):
        req = GenerateRequest("r", "m", SamplingParams(), self.reply_to, max_tokens=5, **fields)
        await self.dw._handle(req)
        if await self.conductor.poll(100):
            return FrameCodec(ToConductor).decode(await self.conductor.recv_multipart())
        return FrameCodec(ToApi).decode(await self.api.recv_multipart())

    def close(self) -> None:
        self.conductor.close(0)
        self.api.close(0)
        self.dw.pushers.close()
        self.dw.ctx.destroy(0)
        self.ctx.destroy(0)


async def test_process_prompt_metadata_reaches_the_engine_and_owned_keys_are_not_the_clients(tmp_path):
    """`process_prompt`'s metadata travels in NewRequest.metadata (its prompt_len is the
    frame's); a client's option for a key the spec sets is dropped, others pass."""
    sink = _Sink(tmp_path, ModelSource("null"))
    try:
        msg, _ = await sink.send(input_ids=[72, 105, 33], options={"prompt_len": 999, "colour": "blue"})
        assert isinstance(msg, NewRequest)
        assert msg.metadata == {"prompt_len": 3, "colour": "blue"} and msg.prompt_len == 3
        assert sink.dw.recent["r"].metadata == msg.metadata  # kept with the layout-free copy
        msg, _ = await sink.send(input_ids=[72], audio=b"RIFF")
        assert isinstance(msg, RequestError) and msg.param == "file" and msg.kind == ErrorKind.INVALID
    finally:
        sink.close()


async def test_audio_goes_through_the_specs_process_prompt(tmp_path, whisper_ckpt, monkeypatch):  # noqa: F811
    """A speech request reaches the spec's process_prompt whole (no tokenizing, the file
    undecoded, the options); the features it makes travel, the data worker never decodes
    audio itself, and the client cannot set what the spec sets (detect_language here)."""
    source = ModelSource(str(whisper_ckpt))
    sink = _Sink(tmp_path, source)
    seen = []
    real = sink.dw.spec.process_prompt
    monkeypatch.setattr(sink.dw.spec, "process_prompt", lambda request: seen.append(request) or real(request))
    audio = wav_bytes(sine_sweep(1.0), 16000)
    try:
        msg, bufs = await sink.send(audio=audio, task="transcribe", options={"detect_language": False, "x": 1})
        assert isinstance(msg, NewRequest)
        (request,) = seen
        assert request.token_ids == [] and request.audio == audio
        assert request.options == {"detect_language": False, "x": 1, "task": "transcribe"}
        tensors = unpack_tensors(msg.input_tensors, bufs)
        assert np.array_equal(tensors["input_features"], audio_features(audio, sink.dw.spec.features))
        assert msg.metadata == {"prompt_len": 4, "language": None, "task": "transcribe", "detect_language": True,
                                "x": 1}
        assert msg.kv_layout["self"].scratch == 1 and msg.prompt_len == 4
        msg, _ = await sink.send(audio=audio, language="xx")
        assert isinstance(msg, RequestError) and msg.param == "language" and "'xx' is not supported" in msg.message
        msg, _ = await sink.send(audio=b"\x00garbage")
        assert isinstance(msg, RequestError) and msg.param == "file" and "could not be decoded" in msg.message
        msg, _ = await sink.send(prompt="hello")
        assert isinstance(msg, RequestError) and msg.param == "file"
    finally:
        sink.close()
