"""The runner of Qwen3-TTS (shared/specs/qwen3_tts.py): CSM's runner (runners/csm.py) over
Qwen3-TTS' talker and code predictor; one engine step makes one frame of every request
that samples in it.

What differs from CSM's:
- rows: a prompt chunk's rows are the spec's `row_id`s (projected text plus codec
  embeddings), a decoding request's row its previous frame (summed code embeddings plus the
  projected `tts_pad`, or in streaming-text mode the text's next id: `text_feed`, set at
  admission), both through the model's `backbone`;
- the codebook loop inside the step (the "code" label's rows are scratch, as CSM's depth
  rows): the talker's last hidden state and the first code start the code predictor,
  `num_codebooks - 1` steps batched over the requests that sample;
- the first code, as the package's `generate` samples it: the 1024 ids past the codes
  masked except `codec_eos`, `codec_eos` masked for the first two frames (min_new_tokens
  2), then the request's repetition penalty (over the first codes generated, never the
  prompt), temperature, top-k, top-p; the other codes with generation_config.json's
  `subtalker_*` sampling (greedy where `subtalker_dosample` is false or the request is);
- a frame whose first code is `codec_eos` ends the request and makes no sound (the
  package cuts its codes there);
- a Base checkpoint's reference clip: at admission (`prepare`) the speaker encoder makes
  its x-vector (unless the prefix cache holds its row), added to the speaker row of the
  prompt chunk that holds it (`_prompt_rows`); in ICL mode (the clip with its transcript)
  the codec's encoder (codecs/qwen3_tts_encoder.py) makes the clip's codes, the prompt's
  last rows (frame rows, as a decoding request's: unless the prefix cache holds them)
  and the start of the request's sound (below);
- sound: each output's new frames go to the request's codec stream (Code2Wav's, over the
  12 Hz decoder: codecs/qwen3_tts_codec.py) in the codec thread, `CHUNK_FRAMES` frames'
  samples at a time (the rest with the request's last output). In ICL mode the stream
  starts with the clip's codes and their samples are dropped (`PrimedStream`): the
  package decodes the clip's codes and the new ones as one clip and cuts the clip's part.
  Its cut is `int(ref / total * samples)`, which float rounding leaves one sample short
  for some lengths (ref 21 of 23 frames, say): there its output starts with the clip's
  last sample, which a stream cannot know before the last frame; this one always cuts
  the clip's samples exactly (`ref * samples_per_frame`).

Unlike the package, a frame's other codes are made in the step that samples its first
code: `max_tokens` frames make `max_tokens` frames of sound (the package's
`max_new_tokens` n makes n - 1: it runs the predictor for a code only when it feeds the
next step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.gpu_worker.codec_thread import CodecThread, sound_bytes
from services.gpu_worker.codecs.code2wav import Code2WavStream
from services.gpu_worker.codecs.qwen3_tts_codec import Qwen3TTSCodec
from services.gpu_worker.codecs.qwen3_tts_encoder import Qwen3TTSEncoder
from services.gpu_worker.request import Request
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.runners.csm import CsmRunner
from services.gpu_worker.runners.frame_rows import StepRows
from services.gpu_worker.sampler import Row
from services.gpu_worker.step_types import Failure, PlanEntry
from shared.frames import Output, SamplingParams
from shared.specs.base import Qwen3TTSRunnerSpec

log = logging.getLogger("mstar.qwen3_tts_runner")

#: frames a chunk after the first gathers (each decode call has a fixed cost)
CHUNK_FRAMES = 4
#: the package's `generate`: the top 1024 ids are control ids, never sampled but codec_eos
SUPPRESSED_TAIL = 1024
MIN_NEW_TOKENS = 2


class Qwen3TTSRunner(CsmRunner):
    SPEC = Qwen3TTSRunnerSpec  # type: ignore[assignment]  # CSM's protocol is not what it reads
    needs_prepare = False

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        self.backbone_label, self.depth_label = spec.label(spec.backbone_label), spec.label(spec.depth_label)
        ModelRunner.__init__(self, model, spec, kv, caches, planner)
        self.depth_caches = caches[self.depth_label.pool]
        self.needs_prepare = True  # a Base checkpoint's clips; the streamed text (`text_feed`)
        self.tts_codec = Qwen3TTSCodec(spec.codec_path, spec.codec_config)
        codec = self.tts_codec
        if codec.quantizers != spec.num_codebooks or codec.codebook_size != spec.codebook_vocab:
            raise ValueError(f"the codec has {codec.quantizers} codebooks of {codec.codebook_size}; the "
                             f"model writes {spec.num_codebooks} of {spec.codebook_vocab}")
        self.thread = CodecThread()
        self.encoder = None
        #: a Base checkpoint's codec encoder (ICL mode's clips)
        self.clip_encoder: Qwen3TTSEncoder | None = None
        if model.speaker_encoder is not None:
            try:
                self.clip_encoder = Qwen3TTSEncoder(spec.codec_path, spec.codec_config, self.device)
            except (ValueError, KeyError) as exc:  # a codec saved without its encoder
                log.warning("no codec encoder (%s): clips with a transcript (ICL) will fail", exc)
        sub = spec.subtalker
        self.subtalker = SamplingParams(temperature=float(sub["subtalker_temperature"]) if sub["subtalker_dosample"]
                                        else 0.0, top_k=int(sub["subtalker_top_k"] or 0),
                                        top_p=float(sub["subtalker_top_p"]))

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: "input_ids", and a Base checkpoint's reference clip ("context_audio",
        24 kHz) with its speaker row's place ("clip_row") and its frames in ICL mode
        ("ref_frames": the prompt's last rows; 0 in x-vector mode)."""
        prompt, _ = ModelRunner.make_request(self, tensors)
        feed = {"trailing": [int(t) for t in tensors["trailing"].reshape(-1)]} if "trailing" in tensors else {}
        if "context_audio" not in tensors:
            return prompt, feed
        frames = int(np.asarray(tensors.get("ref_frames", [0])).reshape(-1)[0])
        texts = np.asarray(tensors.get("frame_texts", np.full(frames, self.spec.tts_pad)), dtype=np.int64)
        texts = texts.reshape(-1)
        if len(texts) != frames:
            raise ValueError(f"frame_texts holds {len(texts)} ids for {frames} clip frames")
        return prompt, {**feed, "clip": np.asarray(tensors["context_audio"], dtype=np.float32).reshape(-1),
                        "clip_row": int(np.asarray(tensors["clip_row"]).reshape(-1)[0]), "ref_frames": frames,
                        "frame_texts": texts}

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Each newly admitted request's reference clip (`_clip_rows`)."""
        failures = []
        for r in admitted:
            r.text_feed = tuple(r.inputs.get("trailing", ()))
            if "clip" not in r.inputs:
                continue
            try:
                self._clip_rows(r)
            except _NoEncoder as exc:
                failures.append(Failure(r, str(exc)))
            except Exception as exc:
                log.exception("reading the reference clip of %s failed", r.request_id)
                failures.append(Failure(r, "internal error in the reference clip's encoders", exc))
        return failures

    def _clip_rows(self, r: Request) -> None:
        """The clip's rows, kept on `embeds` as (`ClipRows`, the frames' codes) until the
        prefill reads them: its x-vector unless the prefix cache holds the speaker row; in
        ICL mode its codes, whose frame rows the prefill reads past what the prefix cache
        holds, and which start the request's sound (`codec`: a `PrimedStream`)."""
        clip, frames = r.inputs["clip"], r.inputs["ref_frames"]
        codes = np.zeros((0, self.spec.num_codebooks), dtype=np.int64)
        if frames:
            if self.clip_encoder is None:
                raise _NoEncoder("the model's codec has no encoder: clips with a transcript cannot be read")
            codes = self.clip_encoder.encode(clip)
            if codes.shape != (frames, self.spec.num_codebooks):
                raise ValueError(f"the encoder made {codes.shape} codes of a clip whose prompt holds {frames} frames")
            r.codec = PrimedStream(self.tts_codec.stream(CHUNK_FRAMES), codes, self.tts_codec.samples_per_frame)
        held = ClipRows(r.inputs["clip_row"], None, len(r.prompt) - frames, r.inputs["frame_texts"])
        if held.row >= r.num_computed:
            if self.model.speaker_encoder is None:
                raise _NoEncoder("the model has no speaker encoder: reference clips cannot be read")
            held.vector = self.model.speaker_encoder.embed(clip)
        if held.vector is not None or r.num_computed < len(r.prompt):
            r.embeds = (held, torch.from_numpy(codes))

    def _prompt_rows(self, r: Request, n: int, step: StepRows) -> None:
        """A prompt chunk's rows: ids, and a clip's rows (`_clip_rows`): the chunk that holds
        the speaker row adds the x-vector there; an ICL clip's frame rows (the prompt's
        last) are frame rows, as a decoding request's."""
        lo, hi = r.num_computed, r.num_computed + n
        if r.embeds is None:
            step.text(r.prompt[lo:hi])
            return
        held, codes = r.embeds
        start = step.t
        if lo < min(hi, held.first_frame):
            step.text(r.prompt[lo:min(hi, held.first_frame)])
        for pos in range(max(lo, held.first_frame), hi):
            step.frame(codes[pos - held.first_frame].tolist(), int(held.texts[pos - held.first_frame]))
        if held.vector is not None and lo <= held.row < hi:
            step.vectors.append(held.vector.to(self.device))
            step.vector_rows.append(start + held.row - lo)
            held.vector = None
        if held.vector is None and hi >= len(r.prompt):
            r.embeds = None

    def _decode_text(self, r: Request) -> int:
        """The text id a decode row adds: the streamed text's next (the row of the request's
        k-th frame takes the k-th), then `tts_pad` (always, in non-streaming mode)."""
        k = len(r.output) - 1
        return r.text_feed[k] if k < len(r.text_feed) else self.spec.tts_pad

    def _sample_frames(self, hidden: torch.Tensor, entries: list[PlanEntry]) -> list[int]:
        """Each sampling entry's frame: its first code from the talker's `hidden`, the others
        from the code predictor; kept on the request, returned as its token."""
        reqs = [e.request for e in entries]
        logits = self._first_code_rules(self.model.first_code_logits(hidden), reqs)
        rows = [Row(SamplingParams(temperature=0.0) if r.sampling.greedy else self.subtalker, r.generator)
                for r in reqs]
        return [f[0] for f in self._frames(hidden, logits, entries, rows)]

    def _depth_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The code predictor's logits sampled as the package samples them (nothing masked)."""
        return logits

    def _first_code_rules(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The package's suppressions: control ids (but codec_eos), and codec_eos itself
        for the first `MIN_NEW_TOKENS` frames."""
        eos = self.spec.codec_eos
        keep = logits[:, eos].clone()
        logits[:, max(0, logits.shape[-1] - SUPPRESSED_TAIL):] = float("-inf")
        logits[:, eos] = keep
        for i, r in enumerate(reqs):
            if len(r.output) < MIN_NEW_TOKENS:
                logits[i, eos] = float("-inf")
        return logits

    # -- sound -------------------------------------------------------------------------

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        if request.codec is None:  # an ICL request's was made at admission, primed with its clip's codes
            request.codec = PrimedStream(self.tts_codec.stream(CHUNK_FRAMES), None, self.tts_codec.samples_per_frame)
        frames = request.inputs.pop("new_frames", [])
        self.thread.submit(reply_to, output, self._frames_sound, request.codec, frames,
                           output.finish_reason is not None)
        return True

    def _frames_sound(self, stream: PrimedStream, frames: list[list[int]], last: bool) -> bytes:
        """The samples `frames` made final (in the codec thread); the rest on the last
        output. The codec_eos frame and anything after it make no sound."""
        keep = []
        for f in frames:
            if f[0] == self.spec.codec_eos:
                break
            keep.append(f)
        chunks = [stream.push(np.asarray(keep))] if keep else []
        if last:
            chunks.append(stream.finish())
        return sound_bytes(chunks)



@dataclass
class ClipRows:
    """A Base checkpoint's clip rows until the prefill reads them: the speaker row and its
    x-vector (None once read, or when the prefix cache holds it), the first frame row (an
    ICL clip's; the prompt's length in x-vector mode) and their text ids."""

    row: int
    vector: torch.Tensor | None
    first_frame: int
    #: the text id each frame row adds (`tts_pad`, or the streamed text's)
    texts: np.ndarray


class _NoEncoder(Exception):
    """The checkpoint lacks an encoder a request's clip needs (its 500 says which)."""


class PrimedStream:
    """A request's codec stream that starts with an ICL clip's codes (`ref`) and drops
    their samples: the first push decodes the clip's codes with the first new ones, so
    every later sample is the package's decode of both as one clip."""

    def __init__(self, stream: Code2WavStream, ref: np.ndarray | None, samples_per_frame: int) -> None:
        self.stream = stream
        self.ref = ref
        self.skip = 0 if ref is None else len(ref) * samples_per_frame

    def push(self, frames: np.ndarray) -> np.ndarray:
        if self.ref is not None:
            frames, self.ref = np.concatenate([self.ref, frames]), None
        return self._drop(self.stream.push(frames))

    def finish(self) -> np.ndarray:
        return self._drop(self.stream.finish())

    def _drop(self, samples: np.ndarray) -> np.ndarray:
        cut = min(self.skip, len(samples))
        self.skip -= cut
        return samples[cut:]
