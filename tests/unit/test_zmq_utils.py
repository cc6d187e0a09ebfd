"""`recv_frames` on a `bind_pull` socket (shared/zmq_utils.py): every message in order,
whether it came before the reader started, in a burst or one at a time with the loop
idle between; a malformed frame logged and dropped; the loop's reader gone once the
generator is closed, and a new one taking the socket. On asyncio's loop and uvloop (the
api's)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import pytest
import uvloop
import zmq
import zmq.asyncio

from shared.frames import Dispatched, FrameCodec, ToApi
from shared.zmq_utils import bind_pull, recv_frames


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_every_frame_in_order_and_a_malformed_one_dropped(tmp_path, loop_factory, caplog):
    address = f"ipc://{tmp_path}/pull.sock"
    codec = FrameCodec(ToApi)

    async def main() -> tuple[list[str], bool]:
        ctx = zmq.asyncio.Context()
        pull = bind_pull(ctx, address)
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        got: list[str] = []
        try:
            for i in range(3):  # before the reader exists
                await push.send_multipart(codec.encode(Dispatched(f"early{i}", "w0")))
            async with aclosing(recv_frames(pull, codec, "test peer")) as frames:
                for _ in range(3):
                    got.append((await asyncio.wait_for(anext(frames), 5))[0].request_id)
                await push.send_multipart([b"\xc1 not msgpack"])
                for i in range(50):  # a burst
                    await push.send_multipart(codec.encode(Dispatched(f"burst{i}", "w0")))
                for _ in range(50):
                    got.append((await asyncio.wait_for(anext(frames), 5))[0].request_id)
                for i in range(5):  # one at a time, the loop idle between
                    await asyncio.sleep(0.02)
                    await push.send_multipart(codec.encode(Dispatched(f"late{i}", "w0")))
                    got.append((await asyncio.wait_for(anext(frames), 5))[0].request_id)
            await push.send_multipart(codec.encode(Dispatched("again", "w0")))
            async with aclosing(recv_frames(pull, codec, "test peer")) as frames:  # a new reader takes the socket
                got.append((await asyncio.wait_for(anext(frames), 5))[0].request_id)
            # (asyncio's loop says whether a reader was there; uvloop's returns None)
            reader_left = asyncio.get_running_loop().remove_reader(pull.getsockopt(zmq.FD))
        finally:
            push.close(0)
            pull.close(0)
            ctx.term()
        return got, reader_left

    with caplog.at_level(logging.ERROR, logger="mstar.zmq"), asyncio.Runner(loop_factory=loop_factory) as runner:
        got, reader_left = runner.run(main())
    assert got == ([f"early{i}" for i in range(3)] + [f"burst{i}" for i in range(50)]
                   + [f"late{i}" for i in range(5)] + ["again"])
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["protocol error from test peer"]
    assert reader_left is (None if loop_factory is uvloop.new_event_loop else False)  # closing took it off the loop

