"""Run an asyncio service under uvloop until SIGTERM/SIGINT, then let it clean up."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine

import uvloop


async def _until_signal(main: Coroutine) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def run_service(main: Coroutine) -> None:
    uvloop.run(_until_signal(main))
