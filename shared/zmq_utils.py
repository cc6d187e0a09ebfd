"""Async ZMQ helpers: bind/connect with the right options, a PUSH per peer, and a strict
receive loop that logs and drops malformed frames instead of crashing the service."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from shared.curve import secure_client, secure_server
from shared.frames import FrameCodec

log = logging.getLogger("mstar.zmq")


def _prepare_ipc(address: str) -> None:
    """Make the ipc socket's folder and clear a stale file left by a killed process."""
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)


def cleanup_ipc(address: str) -> None:
    """Remove an ipc socket file this process bound (no stale sockets after shutdown)."""
    if address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://") :])
        except FileNotFoundError:
            pass


def bind(ctx: zmq.asyncio.Context, kind: int, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    _prepare_ipc(address)
    secure_server(sock, address)
    sock.bind(address)
    return sock


def connect(ctx: zmq.asyncio.Context, kind: int, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    secure_client(sock, address)
    sock.connect(address)
    return sock


class Pushers:
    """One connected PUSH socket per peer address, created on first use.

    Replies go to the `reply_to` a request names, so peers need not be configured up front.
    """

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._socks: dict[str, zmq.asyncio.Socket] = {}

    def get(self, address: str) -> zmq.asyncio.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._socks[address] = connect(self._ctx, zmq.PUSH, address)
        return sock

    async def send(self, address: str, frames: list) -> None:
        await self.get(address).send_multipart(frames, copy=False)

    def drop(self, address: str) -> None:
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()


async def recv_frames(
    sock: zmq.asyncio.Socket, codec: FrameCodec, peer: str
) -> AsyncIterator[tuple[Any, list[memoryview]]]:
    """Yield decoded frames forever; a malformed one is logged with its peer and dropped."""
    while True:
        frames = await sock.recv_multipart(copy=False)
        try:
            yield codec.decode([f.buffer for f in frames])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.error("protocol error from %s: %s (frame dropped)", peer, exc)
