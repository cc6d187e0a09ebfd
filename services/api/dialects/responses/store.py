"""Stored responses: what `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` read.

An in-memory store in the api process, bounded two ways so a busy server cannot grow it
without end: at most `max_entries` responses (the least recently used goes first) and each
at most `ttl_s` seconds after it was stored. Nothing survives a restart of the api: an id
from before it is answered as an unknown one (404), which is what a client must handle
anyway for an evicted or expired response. `max_entries` 0 stores nothing.

Each entry holds the response object and the conversation that led to it, as input items
(the previous conversation's, this request's input, then its output as items), so a
request that names it as `previous_response_id` is rendered as if it had sent them all.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from services.api.dialects.responses.schemas import ResponseObject, ResponsesInputItem

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_TTL_S = 3600.0


class StoredResponse(NamedTuple):
    response: ResponseObject
    #: the whole conversation up to and including this response's output, as input items
    items: tuple[ResponsesInputItem, ...]


class ResponseStore:
    """An LRU of stored responses with a time to live (times from `clock`, in seconds)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or ttl_s <= 0:
            raise ValueError(f"the responses store needs max_entries >= 0 and ttl_s > 0, got {max_entries}, {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        #: id -> (entry, when it expires); least recently used first
        self._entries: OrderedDict[str, tuple[StoredResponse, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        now = self._clock()
        self._entries[entry.response.id] = (entry, now + self.ttl_s)
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        # drop expired entries from the cold end (entries past their time further in are
        # dropped when read, or pushed out by the count limit)
        while self._entries:
            first = next(iter(self._entries.values()))
            if first[1] > now:
                break
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None when it was never stored, was evicted or has expired."""
        found = self._entries.get(response_id)
        if found is None:
            return None
        entry, expires = found
        if self._clock() >= expires:
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not there (or had expired)."""
        if self.get(response_id) is None:
            return False
        del self._entries[response_id]
        return True
