"""The data worker keeps only layout-free copies of what it sent, and uses them: an abort
it forwards is logged with the request's sizes, and the copy is dropped."""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from services.data_worker.data_worker import DataWorker
from shared.frames import Abort, FrameCodec, GenerateRequest, NewRequest, SamplingParams, ToConductor
from shared.model_source import ModelSource


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
