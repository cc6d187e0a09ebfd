"""The data worker: tokenizes, runs the model's `process_prompt`, sends `NewRequest`.

After sending, it keeps only `without_layouts()` copies (layouts live on the wire once,
then in the KV manager), bounded to the most recent requests: what a log line needs of a
request it later hears of (an abort forwarded for it names its prompt and output sizes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import zmq
import zmq.asyncio

from shared.errors import ErrorKind, new_error_id
from shared.frames import (
    Abort,
    FrameCodec,
    GenerateRequest,
    NewRequest,
    RequestError,
    ToDataWorker,
    pack_tensors,
)
from shared.model_source import TokenizerBundle
from shared.specs.base import ModelSpec
from shared.zmq_utils import Pushers, bind, cleanup_ipc, recv_frames

log = logging.getLogger("mstar.data_worker")

KEEP_RECENT = 1024


class _ClientError(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


class DataWorker:
    def __init__(self, spec: ModelSpec, tokenizer: TokenizerBundle, addrs: dict[str, str]) -> None:
        self.spec = spec
        self.tok = tokenizer
        self.vocab_size = tokenizer.tokenizer.get_vocab_size()
        self.addrs = addrs
        self.ctx = zmq.asyncio.Context()
        self.pushers = Pushers(self.ctx)
        self.codec = FrameCodec(ToDataWorker)
        self.recent: OrderedDict[str, NewRequest] = OrderedDict()

    async def run(self) -> None:
        pull = bind(self.ctx, zmq.PULL, self.addrs["data_worker"])
        try:
            async for msg, _ in recv_frames(pull, self.codec, "data worker intake"):
                if isinstance(msg, Abort):
                    self._note_abort(msg)
                    await self.pushers.send(self.addrs["conductor"], self.codec.encode(msg))
                    continue
                await self._handle(msg)
        finally:
            pull.close(0)
            self.pushers.close()
            cleanup_ipc(self.addrs["data_worker"])

    def tokenize(self, req: GenerateRequest) -> list[int]:
        """Token ids of the request; raises ValueError with a client-safe message."""
        if req.input_ids is not None:
            bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size}), got {bad[0]}")
            ids = list(req.input_ids)
        else:
            ids = self.tok.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens).ids
        if not ids:
            raise ValueError("the prompt is empty after tokenization")
        return ids

    def prepare(self, req: GenerateRequest):
        """(prompt ids, ProcessPromptOutput) for the request; raises `_ClientError`
        (param, message) for what is the client's fault: a 400, never a 500."""
        if self.spec.takes_audio != (req.audio is not None):
            if req.audio is None:
                raise _ClientError("file", "the served model takes audio: send a file")
            raise _ClientError("file", "the served model does not take audio")
        if req.audio is None:
            try:
                ids = self.tokenize(req)
            except ValueError as exc:
                raise _ClientError("input_ids" if req.input_ids is not None else "prompt", str(exc)) from exc
            return ids, self.spec.process_prompt(ids)
        from shared.audio import audio_features

        try:
            forced = self.spec.forced_ids(req.language, req.task)
        except ValueError as exc:
            raise _ClientError("language", str(exc)) from exc
        try:
            feats = audio_features(req.audio, self.spec.features)
        except ValueError as exc:
            raise _ClientError("file", str(exc)) from exc
        return forced, self.spec.process_audio(feats, forced)

    async def _handle(self, req: GenerateRequest) -> None:
        try:
            ids, ppo = self.prepare(req)
        except _ClientError as exc:
            await self._error(req, RequestError(req.request_id, ErrorKind.INVALID, exc.message, exc.param))
            return
        except Exception:
            error_id = new_error_id()
            log.exception("process_prompt failed for %s (error_id=%s)", req.request_id, error_id)
            await self._error(req, RequestError(req.request_id, ErrorKind.INTERNAL, "internal error",
                                                error_id=error_id))
            return
        try:
            refs, bufs = pack_tensors(ppo.new_input_tensors)
            msg = NewRequest(
                req.request_id, req.model, refs, req.sampling, req.reply_to, len(ids),
                req.max_tokens, ppo.kv_layout, arrival_time=req.arrival_time,
            )
        except Exception:
            error_id = new_error_id()
            log.exception("building NewRequest failed for %s (error_id=%s)", req.request_id, error_id)
            await self._error(req, RequestError(req.request_id, ErrorKind.INTERNAL, "internal error",
                                                error_id=error_id))
            return
        await self.pushers.send(self.addrs["conductor"], self.codec.encode(msg, bufs))
        self.recent[req.request_id] = msg.without_layouts()
        while len(self.recent) > KEEP_RECENT:
            self.recent.popitem(last=False)

    def _note_abort(self, msg: Abort) -> NewRequest | None:
        """Log an abort with what this worker kept of the request (never its layouts), and
        forget the request: nothing more will be heard of it."""
        kept = self.recent.pop(msg.request_id, None)
        if kept is None:
            log.info("abort of %s (%s) forwarded; not among the %d most recent requests", msg.request_id,
                     msg.reason, KEEP_RECENT)
        else:
            log.info("abort of %s (%s) forwarded: prompt %d tokens, max_tokens %s", msg.request_id, msg.reason,
                     kept.prompt_len, kept.max_tokens)
        return kept

    async def _error(self, req: GenerateRequest, err: RequestError) -> None:
        await self.pushers.send(req.reply_to, self.codec.encode(err))
