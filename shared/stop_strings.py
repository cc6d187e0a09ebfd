"""Stop strings over streamed text: find the first match, never leak part of one.

Stop strings are text, so they are checked on detokenized text: by the api on every
request's deltas (services/api/generation.py), and, for a request whose worker must end a
stage at the match itself (an omni model's speech out: its talker speaks only the text
before the match), by the gpu worker too (services/gpu_worker/stop_check.py), with the same
detokenizer and matcher, so both find the match at the same token. Every text delta goes
through `StopMatcher.push`,
which returns only text that can no longer become part of a stop string. Text that ends
with a proper prefix of some stop string (`"\\n\\nUs"` for stop `"\\n\\nUser:"`) is held
back until later text settles it: either the stop string completes (the match is found,
everything from it on is dropped) or it does not (the held text is released).

Why this is enough: if a stop string started in text already released, the released text
would have ended with a proper prefix of it, and that suffix would have been held back.
So a match always starts inside `held + new text`, and `str.find` over that finds it;
the earliest match over all stop strings wins (the output is the text before the first
occurrence of any of them, however the text was split). A match found while a longer stop
string that starts earlier is still incomplete waits for it to be settled (rare: it needs
overlapping stop strings), and `flush` settles it at the end.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filters one request's text deltas; `matched` turns true at the first stop string."""

    __slots__ = ("_held", "_parts", "_stops", "matched")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""
        self._parts: list[str] = []
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    @property
    def text(self) -> str:
        """All text released so far (the deltas joined)."""
        return "".join(self._parts)

    def push(self, text: str) -> str:
        """Add new text; return what may be shown now ('' while held or after a match)."""
        if self.matched is not None or not text:
            return ""
        if not self._stops:
            self._parts.append(text)
            return text
        buf = self._held + text
        cut, which = self._first_match(buf)
        keep = self._longest_partial(buf)
        start = len(buf) - keep  # a stop string may still begin here and not be complete yet
        if which is not None and cut <= start:
            self.matched = which
            self._held = ""
            return self._release(buf[:cut])
        # No match yet, or one that a longer stop string starting earlier may still beat
        # (text "a\na" with stops "\n" and "a\na" cut after "aa\n"): hold from `start`.
        self._held = buf[start:]
        return self._release(buf[:start])

    def _first_match(self, buf: str) -> tuple[int, str | None]:
        """(start, stop) of the earliest complete occurrence of any stop string in `buf`."""
        cut, which = -1, None
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut, which = i, stop
        return cut, which

    def peek(self, text: str) -> str | None:
        """The stop string that the held text and `text` (text not released yet, that may
        still grow) hold, if any; nothing changes."""
        if self.matched is not None:
            return self.matched
        return self._first_match(self._held + text)[1]

    def flush(self) -> str:
        """At the end of generation: held text can no longer grow into a match, but it may
        hold a complete one that was waiting on a longer stop string starting earlier
        (then `matched` turns true and the text ends before it)."""
        held, self._held = self._held, ""
        if self.matched is not None:
            return ""
        cut, which = self._first_match(held)
        if which is not None:
            self.matched = which
            held = held[:cut]
        return self._release(held)

    def _release(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
