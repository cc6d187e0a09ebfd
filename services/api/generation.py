"""One submitted request as a client sees it: outputs in, delta / done events out.

Shared by the non-streaming reply, the SSE stream, the WebSocket and the OpenAI routes, so
text, stop strings, usage, finish reasons, latency metrics and the final status count are
computed in exactly one place whichever way the client asked.

Stop strings: text goes detokenizer -> `StopMatcher`, so no delta ever shows part of a
stop string. At the first match the request is aborted upstream at once (its pages are
freed while the client still reads), the text ends before the match, the finish reason
is "stop", and `token_ids` / `completion_tokens` are the ids received up to then
(including the one that completed the match, as vLLM reports them). A request whose
worker checks its stop strings too (`SamplingParams.stop`: speech out, whose talker goes on
speaking the text up to the match) is not aborted: its text ends at the match the same
way, and its sound comes on until the worker ends it ("stop").
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from services.api.backend import Aborted, RequestHandle
from services.api.errors import from_request_error, internal_error
from services.api.events import DeltaEvent, DoneEvent, Usage
from services.api.metrics import ApiMetrics, status_label
from shared.detokenize import IncrementalDetokenizer
from shared.frames import Output, RequestError, SamplingParams, TokenLogprobs
from shared.stop_strings import StopMatcher


class Generation:
    """Drives one request's queue; counts it once in `mstar_requests_total`.

    Owners call `close()` when they stop listening (finished or not): a request still live
    then is aborted everywhere and counted as `abort`.
    """

    def __init__(
        self,
        handle: RequestHandle,
        detokenizer: IncrementalDetokenizer,
        metrics: ApiMetrics,
        *,
        client_id: str,
        started: float,
        prompt_tokens: int = 0,
        stop: Sequence[str] = (),
        sampling: SamplingParams | None = None,
        count_prompt: bool = True,
        report_cached: bool = False,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.handle = handle
        self.client_id = client_id
        self._detok = detokenizer
        self._stop = StopMatcher(stop)
        self._metrics = metrics
        self._started = started  # time.perf_counter() at arrival
        self._last_token_at: float | None = None
        self._first_token_at: float | None = None
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = 0
        self._report_cached = report_cached  # usage shows cached_tokens (--enable-prompt-tokens-details)
        # its prompt tokens went to the stats window (a prompt's later samples never send
        # theirs: usage and the metrics count a prompt once however many samples it has)
        self._prompt_seen = not count_prompt
        self._count_prompt = count_prompt
        self.finished = False
        self._counted = False
        self._recorded = False  # its finish reason, usage and latencies went to the metrics
        self._metadata: dict[str, str] = {}  # what the engine reported of the run (Output.metadata)
        sampling = sampling or SamplingParams()
        self._stop_ids = frozenset(sampling.stop_token_ids)
        #: the worker ends the request at a stop string itself: no abort at the match
        self._worker_stops = bool(sampling.stop)
        self._eos_ids = eos_ids
        self._hidden: list[int] = []  # a stop token that ended it: counted, its text not shown (vLLM)
        self._eos: list[int] = []  # ... and an end-of-sequence token that did (no stop_reason)
        self._want_logprobs = sampling.logprobs is not None
        self._want_prompt = sampling.prompt_logprobs is not None
        self._logprobs: list[TokenLogprobs] = []
        self._prompt_logprobs: list[TokenLogprobs] = []
        self._prompt_ids: list[int] = []
        self._prompt_sent = False  # on a delta already
        self._pooled = b""  # a pooling request's result (its one output)
        self._audio: list[bytes] = []  # a speech request's chunks so far
        self._pending_audio = b""  # the latest output's chunk, for the next delta
        self._first_audio_at = 0.0
        #: an in-step loop's iterations done and in all, as its outputs last said (a video
        #: job's progress); (0, 0) until one says
        self.steps: tuple[int, int] = (0, 0)

    @property
    def _token_ids(self) -> list[int]:
        tail = self._hidden + self._eos
        return self._detok.token_ids + tail if tail else self._detok.token_ids

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def cancel(self) -> None:
        """Abort the request; a consumer of `events()` then receives a done('abort')."""
        if not self.finished:
            self.handle.abort()

    def close(self, label: str = "abort") -> None:
        """The owner stops listening: abort if still live, and make sure it is counted
        (as `label` if it was not counted yet: `abort`, or `error_5xx` after a bug)."""
        if not self.finished:
            self.finished = True
            self.handle.abort()
            if label == "abort":
                self._record("abort")
        self._count(label)

    def _count(self, label: str) -> None:
        if not self._counted:
            self._counted = True
            self._metrics.count(label)

    def _record(self, finish_reason: str) -> None:
        """Once: the finish reason, usage and latencies. Queue time ends at the conductor's
        `Dispatched` frame, or (when the outputs outran it) at the first token."""
        if self._recorded:
            return
        self._recorded = True
        dispatched = self.handle.dispatched_at
        if dispatched is None:
            dispatched = self._first_token_at
        queue = None if dispatched is None else dispatched - self._started
        e2e = time.perf_counter() - self._started
        self._metrics.finished(finish_reason, self._prompt_tokens if self._count_prompt else 0, len(self._token_ids),
                               e2e, queue)
        if self._audio and self._metrics.sample_rate:
            self._metrics.audio_finished(self._first_audio_at - self._started,
                                         sum(len(a) for a in self._audio) // 4, e2e)

    def _done(self, finish_reason: str) -> DoneEvent:
        self.finished = True
        self._count(status_label(None, finish_reason))
        self._record(finish_reason)
        ids = list(self._token_ids)
        usage = Usage(self._prompt_tokens, len(ids), self._cached_tokens if self._report_cached else None)
        done = DoneEvent(self.client_id, self._stop.text, ids, finish_reason, usage)
        if self._metadata:
            done.metadata = dict(self._metadata)
        if self._pooled:
            done.pooled = self._pooled
        if self._audio:
            done.audio = b"".join(self._audio)
        if finish_reason == "stop" and (self._stop.matched is not None or self._hidden):
            done.stop_reason = self._stop.matched if self._stop.matched is not None else self._hidden[-1]
        if self._want_logprobs:
            done.logprobs = self._logprobs[: len(ids)]
        if self._want_prompt:
            done.prompt_logprobs, done.prompt_token_ids = self._prompt_logprobs, self._prompt_ids
        return done

    def _push(self, ids: list[int], finish: str | None) -> str:
        """The text `ids` complete. A stop token (one of `stop_token_ids`) or an
        end-of-sequence token that ended the request counts as generated but shows no text,
        as in vLLM (special tokens kept or not)."""
        detok = self._detok
        if finish == "stop" and ids and ids[-1] in self._stop_ids:
            raw = detok.push(ids[:-1])
            self._hidden.append(ids[-1])
        elif finish == "stop" and ids and ids[-1] in self._eos_ids:
            raw = detok.push(ids[:-1])
            self._eos.append(ids[-1])
        else:
            raw = detok.push(ids) if ids else ""
        if finish is not None:
            raw += detok.finish()
        return raw

    def _delta(self, text: str, ids: list[int]) -> DeltaEvent:
        delta = DeltaEvent(self.client_id, text, ids)
        if self._pending_audio:
            delta.audio, self._pending_audio = self._pending_audio, b""
        if self._want_logprobs:
            end = len(self._token_ids)
            delta.logprobs = self._logprobs[end - len(ids) : end]
        if self._want_prompt and not self._prompt_sent:
            self._prompt_sent = True
            delta.prompt_logprobs, delta.prompt_token_ids = self._prompt_logprobs, self._prompt_ids
        return delta

    def _output_arrived(self, item: Output) -> None:
        if item.steps_total:
            self.steps = (item.steps_done, item.steps_total)
        if item.pooled:
            self._pooled = item.pooled
        if item.audio:
            if not self._audio:
                self._first_audio_at = time.perf_counter()
            self._audio.append(item.audio)
            self._pending_audio += item.audio
        if item.metadata:
            self._metadata.update(item.metadata)
        if item.logprobs:
            self._logprobs.extend(item.logprobs)
        if item.prompt_token_ids:
            self._prompt_logprobs, self._prompt_ids = item.prompt_logprobs, item.prompt_token_ids
        prompt = 0
        if item.cached_tokens:
            self._cached_tokens = item.cached_tokens
        if item.prompt_tokens:
            self._prompt_tokens = item.prompt_tokens
            if not self._prompt_seen:
                self._prompt_seen, prompt = True, item.prompt_tokens
        n = len(item.token_ids)
        self._metrics.tokens_arrived(prompt, n)
        if not n:
            return
        now = time.perf_counter()
        if self._last_token_at is None:
            self._first_token_at = now
            self._metrics.observe_ttft(now - self._started)
        else:
            self._metrics.observe_itl(now - self._last_token_at, n)
        self._last_token_at = now

    async def events(self) -> AsyncIterator[DeltaEvent | DoneEvent]:
        """Deltas (one per output frame that adds text or ids), then one done.

        Raises `ApiError` when the request fails (a `RequestError` from any peer).
        """
        detok = self._detok
        stop = self._stop
        handle = self.handle
        while not self.finished:
            item = await handle.get()
            if type(item) is Output:
                self._output_arrived(item)
                for ids, finish in _pieces(item, stop.active):
                    text = stop.push(self._push(ids, finish))
                    if stop.matched is not None and not (self._worker_stops and finish is None):
                        if item.finish_reason is None:
                            handle.abort("stop")  # free its pages now, not at max_tokens
                        yield self._delta(text, list(ids))
                        yield self._done("stop")
                        return
                    if finish is not None:
                        text += stop.flush()  # may settle a match held back until now
                        if text or ids or self._pending_audio:
                            yield self._delta(text, list(ids))
                        yield self._done("stop" if stop.matched is not None else finish)
                        return
                    if text or ids or self._pending_audio:  # (a speech-out stage's outputs carry sound alone)
                        yield self._delta(text, list(ids))
                if item.text_end:  # the text is whole: its held characters go now, not at the sound's end
                    text = stop.push(detok.finish())
                    if text:
                        yield self._delta(text, [])
            elif type(item) is Aborted:
                text = stop.push(detok.finish())
                text += stop.flush()
                if text:
                    yield self._delta(text, [])
                yield self._done("abort")
                return
            elif type(item) is RequestError:
                self.finished = True
                err = from_request_error(item)
                self._count(status_label(err.status))
                raise err

    async def collect(self) -> DoneEvent:
        """Run to the end (the non-streaming reply)."""
        async for event in self.events():
            if type(event) is DoneEvent:
                return event
        raise internal_error(f"collecting {self.request_id}: its events ended without a done")


def _pieces(item: Output, stops: bool) -> list[tuple[list[int], str | None]]:
    """An output's tokens as the stop check takes them: all at once, or one at a time when
    stop strings are set and a speculative step sent several, so the request ends at the
    token that completes the match exactly as without speculation (the later ones dropped)."""
    ids = item.token_ids
    if not stops or len(ids) < 2:
        return [(ids, item.finish_reason)]
    last = len(ids) - 1
    return [([tok], item.finish_reason if i == last else None) for i, tok in enumerate(ids)]
