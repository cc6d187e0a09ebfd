"""Several generations answered as one: `n` > 1 samples, or a list of prompts on
`/v1/completions` (choice `i * n + j` is sample j of prompt i, as vLLM numbers them).

Each choice is its own request through data worker, conductor and worker (its own id, and
its own seed stream: `seed + j`). A prompt's samples share its pages: sample 0 is sent
first, and samples 1.. only once its first token is out, when its prompt pages are in the
worker's prefix cache; the later samples then hold those pages (refcounted) instead of
computing and storing the prompt again, and the conductor and the worker both count the
shared pages once when they admit them. A refusal of sample 0 (a length limit) is the
whole request's answer; any choice's failure ends the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import msgspec

from services.api.errors import ApiError, internal_error
from services.api.events import DeltaEvent, DoneEvent
from services.api.generation import Generation
from services.api.validation import SEED_MAX, GenerateParams


@dataclass(frozen=True, slots=True)
class Indexed:
    """An event of choice `index` (not a NamedTuple: its field would shadow tuple.index)."""

    index: int
    event: DeltaEvent | DoneEvent


class Choice(NamedTuple):
    """What choice i generates, and the choice whose first token it waits for (None: none)."""

    params: GenerateParams
    after: int | None


def expand(params: GenerateParams, prompts: list[tuple[str | None, list[int] | None]], n: int) -> list[Choice]:
    """Every choice of a request with these prompts and `n` samples each ([] for one)."""
    if n == 1 and len(prompts) <= 1:
        return []
    out: list[Choice] = []
    for i, (prompt, input_ids) in enumerate(prompts or [(params.prompt, params.input_ids)]):
        for j in range(n):
            seed = params.sampling.seed
            sampling = params.sampling if seed is None else msgspec.structs.replace(
                params.sampling, seed=(seed + j) % (SEED_MAX + 1))
            choice = msgspec.structs.replace(params, request_id=f"{params.request_id}-{len(out)}", sampling=sampling,
                                             prompt=prompt, input_ids=input_ids)
            out.append(Choice(choice, None if j == 0 else i * n))
    return out


class FanOut:
    """Drives the choices' generations; quacks like one `Generation` for `serve` and the
    SSE stream (`events`, `collect`, `cancel`, `close`), its events `Indexed`."""

    def __init__(self, choices: Sequence[Choice], start: Callable[[Choice], Awaitable[Generation]],
                 client_id: str) -> None:
        self.choices = choices
        self.client_id = client_id
        self.request_id = client_id
        self.gens: list[Generation | None] = [None] * len(choices)
        self._start = start
        self._queue: asyncio.Queue[tuple[int, DeltaEvent | DoneEvent | None, ApiError | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False
        self.finished = False

    async def start(self) -> FanOut:
        """Submit the choices that wait for nothing (raises what the first submission raises)."""
        for i, choice in enumerate(self.choices):
            if choice.after is None:
                try:
                    self.gens[i] = await self._start(choice)
                except BaseException:
                    self.close()
                    raise
        return self

    def cancel(self) -> None:
        self._stopped = True
        for g in self.gens:
            if g is not None:
                g.cancel()

    def close(self, label: str = "abort") -> None:
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        for g in self.gens:
            if g is not None:
                g.close(label)

    async def _pump(self, i: int) -> None:
        gen = self.gens[i]
        assert gen is not None
        first = True
        try:
            async for event in gen.events():
                if first:
                    first = False
                    await self._release(i)
                self._queue.put_nowait((i, event, None))
        except ApiError as err:
            self._queue.put_nowait((i, None, err))
        except Exception as exc:  # a bug: the whole request fails with its id
            self._queue.put_nowait((i, None, internal_error(f"choice {i} of {self.request_id}", exc)))

    async def _release(self, i: int) -> None:
        """Choice i has its first token: start the choices that waited for it."""
        for j, choice in enumerate(self.choices):
            if choice.after == i and self.gens[j] is None and not self._stopped:
                try:
                    self.gens[j] = await self._start(choice)
                except ApiError as err:
                    self._queue.put_nowait((j, None, err))
                    continue
                self._tasks.append(asyncio.get_running_loop().create_task(self._pump(j)))

    async def events(self) -> AsyncIterator[Indexed]:
        """Every choice's events as they come; raises the first failure (the rest end)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(i)) for i, g in enumerate(self.gens) if g is not None]
        left = len(self.choices)
        try:
            while left:
                i, event, err = await self._queue.get()
                if err is not None:
                    raise err
                assert event is not None
                yield Indexed(i, event)
                if type(event) is DoneEvent:
                    left -= 1
            self.finished = True
        finally:
            if not self.finished:
                self.close()

    async def collect(self) -> list[DoneEvent]:
        dones: list[DoneEvent | None] = [None] * len(self.choices)
        async for item in self.events():
            if type(item.event) is DoneEvent:
                dones[item.index] = item.event
        if any(d is None for d in dones):
            raise internal_error(f"collecting {self.request_id}: a choice ended without a done")
        return cast("list[DoneEvent]", dones)  # no None left: checked above
