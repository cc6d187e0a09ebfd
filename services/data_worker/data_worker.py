"""The data worker: tokenizes, runs the model's `process_prompt`, sends `NewRequest`.

Every request, text or audio, goes through the spec's `process_prompt` with what it
needs of the request (`PromptRequest`: prompt ids, the audio file, the model options,
images and context audio as the spec's `prepare_image` / `prepare_context` made them);
audio is decoded by the spec's own methods, never here. The `metadata` it returns travels in
`NewRequest.metadata` to the engine, together with the client's model options for keys
the spec does not set: a client's value for a key `process_prompt` sets (the spec's
`metadata_keys`, or one it returned) is dropped, never passed through.

After sending, it keeps only `without_layouts()` copies (layouts live on the wire once,
then in the KV manager), bounded to the most recent requests: what a log line needs of a
request it later hears of (an abort forwarded for it names its prompt and output sizes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from contextlib import aclosing
from typing import Any, Protocol, TypeVar, cast

import msgspec
import zmq
import zmq.asyncio

from shared import curve, trace
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
from shared.specs.base import (
    MetaValue,
    ModelSpec,
    PreparedAudio,
    PreparedClip,
    PreparedImage,
    PreparedVideo,
    PromptError,
    PromptRequest,
)
from shared.specs.image_gen import ImageGenSpec
from shared.specs.policy import PolicySpec
from shared.specs.world import WorldSpec
from shared.zmq_utils import Pushers, bind_pull, cleanup_ipc, recv_frames


class _HasText(Protocol):
    @property
    def text(self) -> str: ...


#: one prepared input (an audio clip, a video): what stands in its placeholder's place
_Made = TypeVar("_Made", bound=_HasText)

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
        pull = bind_pull(self.ctx, self.addrs["data_worker"])
        try:
            async with aclosing(recv_frames(pull, self.codec, "data worker intake")) as frames:
                async for msg, _ in frames:
                    if isinstance(msg, Abort):
                        self._note_abort(msg)
                        await self.pushers.send(self.addrs["conductor"], self.codec.encode(msg))
                        continue
                    await self._handle(msg)
        finally:
            pull.close(0)
            self.pushers.close()
            cleanup_ipc(self.addrs["data_worker"])
            curve.stop(self.ctx)  # else exit hangs on the ZAP handler's socket (a CURVE deployment)

    def tokenize(self, req: GenerateRequest) -> tuple[list[int], int | None]:
        """(the request's token ids, where a text pair's second text starts, else None);
        raises ValueError with a client-safe message. `truncate_prompt_tokens` (an option
        the api sets) keeps at most that many: a text is cut as the tokenizer's own
        truncation cuts (sentence-transformers' way: the special tokens kept at both ends),
        ids the client sent to their first that many."""
        cut = req.options.get("truncate_prompt_tokens")
        limit = cut if isinstance(cut, int) and not isinstance(cut, bool) and cut > 0 else None
        pair_start = None
        if req.input_ids is not None:
            bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size}), got {bad[0]}")
            ids = list(req.input_ids)[:limit]
        else:
            pair = req.options.get("text_pair")
            ids, pair_start = self._encode(req.prompt or "", req.add_special_tokens, limit,
                                           pair if isinstance(pair, str) else None)
        if not ids:
            raise ValueError("the prompt is empty after tokenization")
        return ids, pair_start

    def _encode(self, text: str, specials: bool, limit: int | None, pair: str | None) -> tuple[list[int], int | None]:
        """`text`'s ids (with `pair`, the pair's, by the tokenizer's pair template: a
        cross-encoder's input, whose second text starts where the token type turns 1), at
        most `limit`. The tokenizer is shared, so its truncation is set and unset within
        this one synchronous call."""
        tok = self.tok.tokenizer
        if limit is not None:
            tok.enable_truncation(limit)
        try:
            enc = tok.encode(text, pair, add_special_tokens=specials)
        finally:
            if limit is not None:
                tok.no_truncation()
        if pair is None:
            return enc.ids, None
        return enc.ids, next((i for i, t in enumerate(enc.type_ids) if t == 1), len(enc.ids))

    def prepare(self, req: GenerateRequest):
        """(prompt ids, ProcessPromptOutput, the engine's metadata) for the request; raises
        `_ClientError` (param, message) for what is the client's fault: a 400, never a 500."""
        if isinstance(self.spec, PolicySpec):
            return self.prepare_policy(req, self.spec)
        if isinstance(self.spec, WorldSpec):
            return self.prepare_world(req, self.spec)
        if isinstance(self.spec, ImageGenSpec):
            return self.prepare_diffusion(req, self.spec)
        if self.spec.takes_audio != (req.audio is not None):
            if req.audio is None:
                raise _ClientError("file", "the served model takes audio: send a file")
            raise _ClientError("file", "the served model does not take audio")
        try:
            images, prompt = self.expand_images(req)
            if images:
                req = msgspec.structs.replace(req, prompt=prompt)
            clips, prompt = self.expand_audios(req)
            if clips:
                req = msgspec.structs.replace(req, prompt=prompt)
            videos, prompt = self.expand_videos(req)
            if videos:
                req = msgspec.structs.replace(req, prompt=prompt)
        except PromptError as exc:
            raise _ClientError(exc.param, str(exc)) from exc
        context: tuple[PreparedAudio, ...] = ()
        if req.prompt is not None:
            try:
                text = self.spec.prompt_text(req.prompt, model_options(req))
                context, before = self.expand_context(req)
                joined = self.spec.join_context(before, text, model_options(req)) if before else text
            except PromptError as exc:
                raise _ClientError(exc.param, str(exc)) from exc
            if joined != req.prompt:
                req = msgspec.structs.replace(req, prompt=joined)
        elif req.context:
            raise _ClientError("input_ids", "context turns need a text prompt (the turn to speak), not input_ids")
        ids: list[int] = []
        pair_start = None
        if req.audio is None or req.prompt is not None or req.input_ids is not None:
            try:
                ids, pair_start = self.tokenize(req)
            except ValueError as exc:
                raise _ClientError("input_ids" if req.input_ids is not None else "prompt", str(exc)) from exc
        options = model_options(req)
        options.pop("text_pair", None)  # the api's, read by tokenize: the model sees where it starts
        if pair_start is not None:
            options["pair_start"] = pair_start
        try:
            ppo = self.spec.process_prompt(PromptRequest(ids, req.audio, options, images, context, clips=clips,
                                                           videos=videos))
        except PromptError as exc:
            raise _ClientError(exc.param, str(exc)) from exc
        return ids, ppo, engine_metadata(options, ppo.metadata, self.spec.metadata_keys)

    def prepare_policy(self, req: GenerateRequest, spec: PolicySpec):
        """A robot policy's request: its cameras in the model's order, each preprocessed by
        the spec; the prompt laid out as the model's processor lays it out (image tokens per
        camera, then the text), tokenized whole; the state and noise to the spec as floats."""
        try:
            named = dict(zip(req.cameras, req.images))
            order = spec.camera_order(list(req.cameras))
            images = []
            for name in order:
                try:
                    images.append(spec.prepare_image(named[name]))
                except PromptError as exc:
                    raise PromptError(f"observation.images.{name}", str(exc)) from exc
            text = spec.policy_prompt(req.prompt or "", len(images), req.floats.get("state"))
        except PromptError as exc:
            raise _ClientError(exc.param, str(exc)) from exc
        ids = self.tok.tokenizer.encode(text, add_special_tokens=False).ids
        options = model_options(req)
        floats = {k: tuple(v) for k, v in req.floats.items()}
        try:
            ppo = spec.process_prompt(PromptRequest(ids, None, options, tuple(images), floats=floats,
                                                    cameras=tuple(order)))
        except PromptError as exc:
            raise _ClientError(exc.param, str(exc)) from exc
        return ids, ppo, engine_metadata(options, ppo.metadata, spec.metadata_keys)

    def prepare_world(self, req: GenerateRequest, spec: WorldSpec):
        """A world model's rollout: each frame of the context clip preprocessed by the spec
        (`frames.<i>` names a frame that is not an image), the actions, states and steps to
        the spec, which checks their rows; no text, so no tokenizer."""
        images = []
        for i, data in enumerate(req.images):
            try:
                images.append(spec.prepare_image(data))
            except PromptError as exc:
                raise _ClientError(f"frames.{i}", str(exc)) from exc
        options = model_options(req)
        floats = {k: tuple(v) for k, v in req.floats.items()}
        try:
            ppo = spec.process_prompt(PromptRequest([], None, options, tuple(images), floats=floats))
        except PromptError as exc:
            raise _ClientError(exc.param, str(exc)) from exc
        ids = [int(t) for t in ppo.new_input_tensors["input_ids"]]
        return ids, ppo, engine_metadata(options, ppo.metadata, spec.metadata_keys)

    def prepare_diffusion(self, req: GenerateRequest, spec: ImageGenSpec):
        """An image or video to generate: the prompt and the negative prompt (option
        `negative_prompt`) each rendered as the pipeline renders it (its templates and chat
        template) and tokenized, then the pipeline's two closing ids; the conditional ids
        first, the spec told where they end (`cond_rows`)."""
        options = model_options(req)
        negative = options.pop("negative_prompt", None)
        size = [options.get(k, d) for k, d in (("height", 720), ("width", 1280), ("num_frames", 1))]
        try:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in size):
                raise PromptError("size", "height, width and num_frames must be integers")
            height, width, frames = (int(cast(int, v)) for v in size)
            spec.check_size(width, height, frames)
            texts = spec.prompt_texts(req.prompt or "", negative if isinstance(negative, str) else None, height,
                                      width, frames)
            images = tuple(spec.prepare_image(data) for data in req.images)  # an edit's input image
        except PromptError as exc:
            raise _ClientError(exc.param, str(exc)) from exc
        cond, uncond = (self.tok.tokenizer.encode(t, add_special_tokens=False).ids + spec.suffix_ids for t in texts)
        options["cond_rows"] = len(cond)
        try:
            ppo = spec.process_prompt(PromptRequest(cond + uncond, None, options, images))
        except PromptError as exc:
            raise _ClientError(exc.param, str(exc)) from exc
        ids = [int(t) for t in ppo.new_input_tensors["input_ids"]]
        return ids, ppo, engine_metadata(options, ppo.metadata, spec.metadata_keys)

    def expand_images(self, req: GenerateRequest) -> tuple[tuple[PreparedImage, ...], str | None]:
        """(the request's images preprocessed by the spec's `prepare_image`: decoded,
        resized, tiled, normalized; the prompt with each one's text in place of its
        placeholder), so the prompt is tokenized once, whole, as the model's processor
        tokenizes it (tokens merge across the boundary: Gemma 3's newlines).
        `PromptError` when the placeholders and the images do not pair up one to one."""
        placeholder = self.spec.image_placeholder
        if not req.images:
            return (), req.prompt
        if not placeholder:
            raise PromptError("images", "the served model does not take images")
        if req.prompt is None:
            raise PromptError("input_ids", "images need a text prompt (with the image placeholder), not input_ids")
        parts = req.prompt.split(placeholder)
        if len(parts) - 1 != len(req.images):
            raise PromptError("prompt", f"the prompt holds {len(parts) - 1} image placeholder(s) "
                                        f"({placeholder!r}) for {len(req.images)} image(s)")
        images = []
        for i, data in enumerate(req.images):
            try:
                images.append(self.spec.prepare_image(data))
            except PromptError as exc:
                raise PromptError(f"images[{i}]", str(exc)) from exc
        return tuple(images), parts[0] + "".join(img.text + part for img, part in zip(images, parts[1:]))

    def expand_audios(self, req: GenerateRequest) -> tuple[tuple[PreparedClip, ...], str | None]:
        """(the request's audio inputs made into features by the spec's `prepare_audio`; the
        prompt with each one's tokens in place of its placeholder), as `expand_images`."""
        return self._expand(req.audios, req.prompt, "audio", self.spec.audio_placeholder, self.spec.prepare_audios)

    def expand_videos(self, req: GenerateRequest) -> tuple[tuple[PreparedVideo, ...], str | None]:
        """(the request's video inputs made into patches by the spec's `prepare_videos`; the
        prompt with each one's tokens in place of its placeholder), as `expand_images`."""
        return self._expand(req.videos, req.prompt, "video", self.spec.video_placeholder, self.spec.prepare_videos)

    @staticmethod
    def _expand(items: Any, prompt: str | None, kind: str, placeholder: str | None,
                prepare: Callable[[Any], tuple[_Made, ...]]) -> tuple[tuple[_Made, ...], str | None]:
        """`kind`'s inputs (field `kind + "s"`) paired one to one with `placeholder` in the
        prompt, prepared all at once; the prompt with each one's text in its placeholder's place."""
        if not items:
            return (), prompt
        if not placeholder:
            raise PromptError(f"{kind}s", f"the served model does not take {kind} inputs")
        if prompt is None:
            raise PromptError("input_ids", f"{kind} inputs need a text prompt (with the {kind} placeholder), "
                                           "not input_ids")
        parts = prompt.split(placeholder)
        if len(parts) - 1 != len(items):
            raise PromptError("prompt", f"the prompt holds {len(parts) - 1} {kind} placeholder(s) "
                                        f"({placeholder!r}) for {len(items)} {kind} input(s)")
        made = prepare(items)
        return made, parts[0] + "".join(m.text + part for m, part in zip(made, parts[1:]))

    def expand_context(self, req: GenerateRequest) -> tuple[tuple[PreparedAudio, ...], str]:
        """(the request's context audio, decoded by the spec's `prepare_context`; the text
        of its earlier turns, each audio's placeholder expanded to its frames), so the
        whole conversation is tokenized once, as the model's processor tokenizes it."""
        if not req.context:
            return (), ""
        return self.spec.prepare_context(req.context)

    async def _handle(self, req: GenerateRequest) -> None:
        trace.stamp(req.request_id, "dw.recv")
        try:
            ids, ppo, metadata = self.prepare(req)
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
            trace.stamp(req.request_id, "dw.prepared")
            refs, bufs = pack_tensors(ppo.new_input_tensors)
            prompt_len = int(ppo.metadata.get("prompt_len", len(ids)))
            msg = NewRequest(
                req.request_id, req.model, refs, req.sampling, req.reply_to, prompt_len,
                req.max_tokens, ppo.kv_layout, arrival_time=req.arrival_time, metadata=metadata,
                max_tokens_default=req.max_tokens_default,
            )
        except Exception:
            error_id = new_error_id()
            log.exception("building NewRequest failed for %s (error_id=%s)", req.request_id, error_id)
            await self._error(req, RequestError(req.request_id, ErrorKind.INTERNAL, "internal error",
                                                error_id=error_id))
            return
        trace.stamp(req.request_id, "dw.send")
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


def model_options(req: GenerateRequest) -> dict[str, MetaValue]:
    """The request's per-model options: `options`, and the typed fields (language, task)
    the api sets for speech models; None values are left out."""
    options: dict[str, MetaValue] = {k: v for k, v in req.options.items() if v is not None}
    for name, value in (("language", req.language), ("task", req.task)):
        if value is not None:
            options[name] = value
    return options


def engine_metadata(options: dict[str, MetaValue], metadata: dict, owned: frozenset[str]) -> dict[str, MetaValue]:
    """What reaches the engine: `process_prompt`'s metadata, and the client's options for
    every other key (a key the spec sets itself is never taken from the client)."""
    keep = {k: v for k, v in options.items() if k not in owned and k not in metadata}
    return {**keep, **metadata}
