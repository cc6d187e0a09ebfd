"""The runner of Higgs Audio v2 (shared/specs/higgs.py): one engine step makes one frame
(all 8 codebooks) of every request that samples in it.

The step loop, admission, footprints and stop checks are the decoder's; what is Higgs' own:
- the rows: a prompt chunk's text ids, or a decoding request's previous frame (its codes'
  embeddings summed), on the audio norms and MLPs (modeling/speech/higgs.py);
- the delay pattern (`DelayPattern`, transformers' `HiggsAudioV2DelayPatternLogitsProcessor`
  and the flat token its `_sample` appends): before sampling, codebooks still before
  their start are forced to the stream BOS, and once a frame held an EOS, one more
  codebook each frame is forced to the stream EOS;
- sampling: each codebook a row with the request's temperature / top-k / top-p / min-p
  (transformers' Higgs refuses penalties); when sampling (temperature > 0), Boson's
  repetition-aware sampling: a code that already appears `ras_win_max_num_repeat` times
  in its codebook over the last `ras_win_len` frames (stream BOS / EOS not counted) is
  drawn again from the softmax of the raw logits. A greedy request is argmax, never
  redrawn (transformers would draw at random there: its RAS runs under greedy too);
- the token a frame is sent as: its codebook-0 code, or `eos_frame_token` for the all-EOS
  frame that ends the request;
- reference clips (voice cloning): at admission (`prepare`) the codec's encoder
  (codecs/higgs_encoder.py) turns each clip into codes, once per request (not for a clip
  whose rows the prefix cache holds), and the clip's placeholder rows take its codes framed
  by the stream BOS / EOS in the delay pattern, as audio rows (transformers' processor and
  `build_delay_pattern`); RAS's window holds the generated frames only (transformers'
  includes the clip's, which matters only when sampling);
- sound: each output's new frames go to the request's `DelayedSound` in the codec thread:
  the BOS frame dropped, the delay reverted (a codec frame is final once the frame 7
  later arrives), codes clipped to the codec's, and the codec's exact stream
  (codecs/higgs_codec.py) emits samples as soon as they are final, then `CHUNK_FRAMES` at
  a time.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.gpu_worker.attention import cpu_backend
from services.gpu_worker.codec_thread import CodecThread, HeldSound, sound_bytes
from services.gpu_worker.codecs.higgs_codec import HiggsCodec, HiggsStream
from services.gpu_worker.codecs.higgs_encoder import HiggsEncoder
from services.gpu_worker.request import Request
from services.gpu_worker.runners.frame_rows import FrameBackboneRunner
from services.gpu_worker.sampler import Row, sample
from services.gpu_worker.step_types import Failure, PlanEntry
from shared.frames import Output, SamplingParams
from shared.specs.base import HiggsRunnerSpec
from shared.specs.higgs import encoded_frames

log = logging.getLogger("mstar.higgs_runner")

#: codec frames a chunk after the first gathers (each decode re-reads the codec's radius)
CHUNK_FRAMES = 4


class DelayPattern:
    """One request's delay-pattern state, as transformers' logits processor keeps it per
    batch row: `bos[k]` >= 0 forces codebook k to the stream BOS (then counts down each
    frame), `eos[k]` <= 0 forces it to the stream EOS (counting down each frame whose
    previous flat token was the delay token); `last` is that flat token."""

    def __init__(self, spec, prompt: list[int]) -> None:
        n = spec.num_codebooks
        window = prompt[-n:]
        pattern = np.arange(1, n + 1)
        self.spec = spec
        self.bos = pattern - (n - window.index(spec.audio_bos_token_id)) if spec.audio_bos_token_id in window \
            else np.zeros(n, dtype=np.int64)
        self.eos = pattern - (n - window.index(spec.audio_delay_token_id)) \
            if spec.audio_delay_token_id in window else pattern.copy()
        self.last = prompt[-1]

    def forced(self) -> tuple[np.ndarray, np.ndarray]:
        """(codebooks forced to BOS, to EOS) this frame; the countdowns advance."""
        bos = self.bos >= 0
        self.bos[bos] -= 1
        if self.last == self.spec.audio_delay_token_id:
            self.eos -= 1
        return bos, self.eos <= 0

    def advance(self, codes: list[int]) -> bool:
        """The flat token after a frame of `codes`; True when the frame is all EOS (the end)."""
        eos = self.spec.stream_eos
        done = all(c == eos for c in codes)
        if any(c == eos for c in codes) or self.last == self.spec.audio_delay_token_id:
            self.last = self.spec.audio_delay_token_id
        else:
            self.last = self.spec.audio_token_id
        return done


class HiggsRunner(HeldSound, FrameBackboneRunner):
    SPEC = HiggsRunnerSpec
    needs_prepare = True

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        self.backbone_label = spec.label(spec.label_name)
        super().__init__(model, spec, kv, caches, planner)
        self.codec = HiggsCodec(spec.codec_path, spec.codec_config, self.device)
        if self.codec.num_quantizers != spec.num_codebooks:
            raise ValueError(f"the codec has {self.codec.num_quantizers} codebooks; the model writes "
                             f"{spec.num_codebooks}")
        self.thread = CodecThread()
        try:
            self.encoder: HiggsEncoder | None = HiggsEncoder(spec.codec_path, spec.codec_config, self.device)
        except ValueError as exc:  # a codec saved without its encoder: reference clips cannot be read
            log.warning("no codec encoder (%s): requests with context audio will fail", exc)
            self.encoder = None

    def _backend(self) -> str:
        """The C kernels where they take the stack's attention, else torch (no FlashInfer plan:
        the step is not a decoder LM's token rows)."""
        if self.device.type != "cpu":
            return "torch"
        compute = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        cfg = self.spec.config
        pick = cpu_backend(self.caches[self.spec.pool][0].dtype, compute, None, cfg.num_attention_heads,
                           cfg.num_key_value_heads)
        return "kernel" if pick == "kernel" else "torch"

    # -- voice cloning: reference clips --------------------------------------------------

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: "input_ids" [P], and for a request with reference clips the clips
        concatenated ("context_audio", float32 at the codec's rate) and where each ends
        ("context_cutoffs"); their rows are the prompt's placeholders (`<|AUDIO_OUT|>` and
        the delay token), `clip_rows` a clip."""
        prompt, _ = super().make_request(tensors)
        audio = tensors.get("context_audio")
        if audio is None:
            return prompt, {}
        cutoffs = [int(c) for c in tensors["context_cutoffs"].reshape(-1)]
        clips = np.split(np.asarray(audio, dtype=np.float32).reshape(-1), cutoffs[:-1])
        ids = np.asarray(prompt)
        where = np.flatnonzero((ids == self.spec.audio_token_id) | (ids == self.spec.audio_delay_token_id))
        frames = [encoded_frames(len(c), self.spec.codec_config) for c in clips]
        if len(where) != sum(self.spec.clip_rows(n) for n in frames):
            raise ValueError(f"the prompt holds {len(where)} audio rows; its clips make "
                             f"{sum(self.spec.clip_rows(n) for n in frames)}")
        return prompt, {"clips": clips, "where": where, "frames": frames}

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Encode the reference clips of newly admitted requests (each clip whose rows the
        prefix cache does not hold); a request keeps its clips' delayed frames on `embeds`."""
        failures = []
        for r in admitted:
            if "clips" not in r.inputs:
                continue
            if self.encoder is None:
                failures.append(Failure(r, "the model's codec has no encoder: reference clips cannot be read"))
                continue
            try:
                r.embeds = self._clip_frames(r)
            except Exception as exc:
                log.exception("the codec encoder failed on %s", r.request_id)
                failures.append(Failure(r, "internal error in the codec encoder", exc))
        return failures

    def _clip_frames(self, r: Request) -> tuple[np.ndarray, torch.Tensor]:
        """(the prompt positions of every clip row; their codes [rows, num_codebooks]): each
        clip's codes framed by the stream BOS and EOS, in the delay pattern (transformers'
        `build_delay_pattern`)."""
        assert self.encoder is not None
        k = self.spec.num_codebooks
        parts, at = [], 0
        for clip, n in zip(r.inputs["clips"], r.inputs["frames"]):
            rows = r.inputs["where"][at: at + self.spec.clip_rows(n)]
            cached = rows[-1] < r.num_computed  # the prefix cache holds them: never read
            codes = np.zeros((n, k), dtype=np.int64) if cached else self.encoder.encode(clip)
            if codes.shape != (n, k):
                raise ValueError(f"the encoder made {codes.shape} codes of a clip whose prompt holds {n} frames")
            parts.append(self._delayed(codes))
            at += len(rows)
        return r.inputs["where"], torch.from_numpy(np.concatenate(parts))

    def _delayed(self, codes: np.ndarray) -> np.ndarray:
        """Codes [n, K] with a BOS frame before and an EOS frame after, codebook k delayed k
        frames (BOS before, EOS after): [n + 2 + K - 1, K]."""
        n, k = codes.shape
        seq = np.concatenate([np.full((1, k), self.spec.stream_bos), codes, np.full((1, k), self.spec.stream_eos)])
        out = np.full((n + 2 + k - 1, k), self.spec.stream_eos, dtype=np.int64)
        for j in range(k):
            out[:j, j] = self.spec.stream_bos
            out[j: j + n + 2, j] = seq[:, j]
        return out

    def _sample_frames(self, hidden: torch.Tensor, entries: list[PlanEntry]) -> list[int]:
        return self._frames(self.model.code_logits(hidden), entries)

    def _frames(self, logits: torch.Tensor, entries: list[PlanEntry]) -> list[int]:
        """Each sampling entry's frame from its logits [B, num_codebooks, codebook_size]:
        the delay pattern's forced codebooks, then each codebook sampled (RAS when
        sampling); kept on the request, returned as its token."""
        reqs = [e.request for e in entries]
        raw = logits.clone()
        forced = [self._pattern(r).forced() for r in reqs]
        bos = torch.tensor(np.stack([f[0] for f in forced]), device=logits.device)
        eos = torch.tensor(np.stack([f[1] for f in forced]), device=logits.device)
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(bos[..., None] & (vocab != self.spec.stream_bos), float("-inf"))
        logits = logits.masked_fill(eos[..., None] & (vocab != self.spec.stream_eos), float("-inf"))
        k = self.spec.num_codebooks
        rows = [row for r in reqs for row in [self._codebook_row(r)] * k]
        codes = np.asarray(sample(logits.reshape(len(reqs) * k, -1), rows)[0]).reshape(len(reqs), k)
        out = []
        for i, r in enumerate(reqs):
            frame = self._repetition_aware(r, codes[i].tolist(), raw[i])
            r.inputs["last_frame"] = frame
            r.inputs.setdefault("frames", []).append(frame)
            r.inputs.setdefault("new_frames", []).append(frame)
            out.append(self.spec.eos_frame_token if self._pattern(r).advance(frame) else frame[0])
        return out

    def _pattern(self, r: Request) -> DelayPattern:
        if "delay" not in r.inputs:
            r.inputs["delay"] = DelayPattern(self.spec, list(r.prompt))
        return r.inputs["delay"]

    def _codebook_row(self, r: Request) -> Row:
        """A codebook's sampling for `r`: its temperature, top-k, top-p, min-p."""
        sp = r.sampling
        return Row(SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p),
                   r.generator)

    def _repetition_aware(self, r: Request, codes: list[int], raw: torch.Tensor) -> list[int]:
        """Boson's RAS (as transformers' `_sample` applies it), for a sampling request: a
        code repeated `ras_max_repeat` times in its codebook over the last `ras_win_len`
        frames is drawn again from softmax(raw logits)."""
        win, most = self.spec.ras_win_len, self.spec.ras_max_repeat
        past = r.inputs.get("frames")
        if r.sampling.temperature <= 0 or win <= 0 or most <= 0 or not past:
            return codes
        window = np.asarray(past[-win:])
        counted = (window != self.spec.stream_bos) & (window != self.spec.stream_eos)
        repeats = ((window == np.asarray(codes)) & counted).sum(axis=0)
        for k in np.flatnonzero(repeats >= most).tolist():
            probs = raw[k].float().softmax(-1).cpu()
            codes[k] = int(torch.multinomial(probs, 1, generator=r.generator))
        return codes

    # -- sound -------------------------------------------------------------------------

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        if request.codec is None:
            request.codec = DelayedSound(self.codec.stream(CHUNK_FRAMES), self.spec)
        frames = request.inputs.pop("new_frames", [])
        self.thread.submit(reply_to, output, request.codec.sound, frames, output.finish_reason is not None)
        return True


class DelayedSound:
    """Delayed frames in (the model's, BOS frame first), codec frames out to the stream:
    the BOS frame is dropped, the all-EOS frame and what follows are not sound, and codec
    frame t is codebook k of delayed frame t + k, for each k (`revert_delay_pattern`),
    clipped to the codec's codes (HiggsAudioV2Processor.batch_decode)."""

    def __init__(self, stream: HiggsStream, spec) -> None:
        self.stream, self.spec = stream, spec
        self.delayed: list[list[int]] = []
        self.seen = 0  # delayed frames received, the BOS frame included
        self.ended = False
        self.reverted = 0

    def sound(self, frames: list[list[int]], last: bool) -> bytes:
        """The samples `frames` made final (in the codec thread); the rest on the last output."""
        eos = self.spec.stream_eos
        for f in frames:
            self.seen += 1
            if self.seen == 1 or self.ended:
                continue  # the BOS frame
            if all(c == eos for c in f):
                self.ended = True
                continue
            self.delayed.append(f)
        chunks = [self.stream.push(self._revert())]
        if last:
            chunks.append(self.stream.finish())
        return sound_bytes([c for c in chunks if len(c)])

    def _revert(self) -> np.ndarray:
        """Codec frames whose every codebook has arrived since the last call."""
        k = self.spec.num_codebooks
        base = self.reverted  # delayed[0] is delayed frame `base` (those before it are spent)
        ready = max(base, base + len(self.delayed) - (k - 1))
        d = np.asarray(self.delayed, dtype=np.int64).reshape(-1, k)
        out = np.stack([d[t - base + np.arange(k), np.arange(k)] for t in range(base, ready)]) \
            if ready > base else np.zeros((0, k), dtype=np.int64)
        self.delayed = self.delayed[ready - base:]
        self.reverted = ready
        return np.clip(out, 0, self.spec.stream_bos - 1)
