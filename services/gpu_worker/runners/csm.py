"""The runner of CSM (shared/specs/csm.py): one engine step makes one frame of every
request that samples in it.

The step loop, admission, footprints and stop checks are the decoder's; what is CSM's own:
- the backbone rows: a prompt chunk's text ids, or a decoding request's previous frame
  (its codes' embeddings summed), on the "backbone" label as any decoder's rows;
- the codebook loop inside the step: for the requests that sample (a prompt's last chunk
  or a decode row), the backbone's last hidden state and first code start the depth
  decoder, whose `num_codebooks - 1` steps (the request's `codebook_loop` cap) run batched
  over those requests, each a row per request on the "depth" label. Those rows are
  scratch: the scheduler reserves them before the step (`step_scratch`) and gives their
  pages back after it, so the same pages serve every frame;
- sampling: the first code with the request's sampling (transformers' generate samples it
  from the backbone's logits), each other code with the same temperature / top-k / top-p
  (no penalties: they are a sequence's, not a frame's codebooks'); codes past the codec's
  codebook size are never sampled (the real model's vocabulary has 3 it cannot decode);
- the token a frame is sent as: its first code, or `eos_frame_token` for the frame that
  ends the request (codes other than the last all `codebook_eos_token_id`, transformers'
  stop rule);
- context turns (voice continuation): at admission (`prepare`) Mimi's encoder
  (codecs/mimi_encoder.py) turns each context clip into frames, once per request, and the
  prompt's frame rows (each clip's run of `<|AUDIO|>`, and the `<|audio_eos|>` closing
  it: an all-zero frame) take those frames' summed embeddings in place of a text
  embedding, as transformers' `_merge_input_ids_with_input_values`; a clip whose rows the
  prefix cache holds (keyed by the clip: shared/specs/csm.py) is not encoded;
- sound: each output's new frames go to the request's `MimiStream` in the codec thread
  (`CodecThread`); the first frame's samples leave at once, later ones `CHUNK_FRAMES` at a
  time; an all-zero frame and what follows make no sound (transformers cuts there).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.gpu_worker.attention import AttnRows, cpu_backend
from services.gpu_worker.codec_thread import CodecThread, HeldSound, sound_bytes
from services.gpu_worker.codecs.mimi_codec import MimiCodec, MimiStream
from services.gpu_worker.codecs.mimi_encoder import MimiEncoder
from services.gpu_worker.request import Request
from services.gpu_worker.runners.frame_rows import FrameBackboneRunner
from services.gpu_worker.sampler import Row, sample
from services.gpu_worker.step_types import Failure, PlanEntry
from shared.frames import Output, SamplingParams
from shared.layout import KVLabel
from shared.specs.base import CsmRunnerSpec
from shared.specs.csm import encoded_frames

log = logging.getLogger("mstar.csm_runner")

#: frames a chunk after the first gathers (each decode call has a fixed cost)
CHUNK_FRAMES = 4


class CsmRunner(HeldSound, FrameBackboneRunner):
    SPEC = CsmRunnerSpec
    needs_prepare = True

    def __init__(self, model, spec, kv, caches: dict[str, list[torch.Tensor]], planner=None) -> None:
        self.backbone_label, self.depth_label = spec.label(spec.backbone_label), spec.label(spec.depth_label)
        super().__init__(model, spec, kv, caches, planner)
        self.depth_caches = caches[self.depth_label.pool]
        self.codec = MimiCodec(spec.codec_path, spec.codec_config)
        if self.codec.codebook_size > spec.codebook_vocab:
            raise ValueError(f"the codec has {self.codec.codebook_size} codes a codebook; the model writes "
                             f"{spec.codebook_vocab}")
        self.thread = CodecThread()
        try:
            self.encoder: MimiEncoder | None = MimiEncoder(spec.codec_path, spec.codec_config)
        except ValueError as exc:  # a codec saved without its encoder: context audio cannot be read
            log.warning("no Mimi encoder (%s): requests with context audio will fail", exc)
            self.encoder = None

    def _backend(self) -> str:
        """The C kernels where they take both stacks' attention, else torch."""
        if self.device.type != "cpu":
            return "torch"
        compute = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        picks = {cpu_backend(self.caches[pool][0].dtype, compute, None, cfg.num_attention_heads,
                             cfg.num_key_value_heads)
                 for pool, cfg in ((self.spec.pool, self.spec.config), (self.spec.depth_pool, self.spec.depth_config))}
        return "kernel" if picks == {"kernel"} else "torch"

    def _layer_caches(self) -> list[torch.Tensor]:
        return list(self.caches[self.spec.pool])

    @property
    def step_labels(self) -> tuple[KVLabel, ...]:
        return (self.backbone_label,)  # the depth rows are scratch (`step_scratch`)

    def check_layout(self, labels: set[str]) -> None:
        want = {self.backbone_label.name, self.depth_label.name}
        if labels != want:
            raise ValueError(f"a CSM request needs layouts for labels {sorted(want)}")

    # -- context audio (voice continuation) --------------------------------------------

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        """`tensors`: "input_ids" [P], and for a request with context audio the clips
        concatenated ("context_audio", float32 at the codec's rate) and where each ends
        ("context_cutoffs"); their frame rows are the prompt's runs of `audio_token_id`."""
        prompt, _ = super().make_request(tensors)
        audio = tensors.get("context_audio")
        if audio is None:
            return prompt, {}
        cutoffs = [int(c) for c in tensors["context_cutoffs"].reshape(-1)]
        clips = np.split(np.asarray(audio, dtype=np.float32).reshape(-1), cutoffs[:-1])
        ids = np.asarray(prompt)
        where = np.flatnonzero(ids == self.spec.audio_token_id)
        frames = [encoded_frames(len(c), self.codec.samples_per_frame) for c in clips]
        if len(where) != sum(frames):
            raise ValueError(f"the prompt holds {len(where)} audio frames; its context audio makes {sum(frames)}")
        closing = np.flatnonzero(ids == self.spec.audio_eos_token_id)
        return prompt, {"clips": clips, "where": where, "frames": frames, "closing": closing}

    def prepare(self, admitted: list[Request], pages: dict[str, dict[str, list[int]]]) -> list[Failure]:
        """Encode the context audio of newly admitted requests (each clip whose rows the
        prefix cache does not hold); a request keeps its frame rows' codes on `embeds`."""
        failures = []
        for r in admitted:
            if "clips" not in r.inputs:
                continue
            if self.encoder is None:
                failures.append(Failure(r, "the model's codec has no encoder: context audio cannot be read"))
                continue
            try:
                r.embeds = self._context_frames(r)
            except Exception as exc:
                log.exception("the Mimi encoder failed on %s", r.request_id)
                failures.append(Failure(r, "internal error in the Mimi encoder", exc))
        return failures

    def _context_frames(self, r: Request) -> tuple[np.ndarray, torch.Tensor]:
        """(the prompt positions of every context frame row: each clip's frames and each
        turn's closing frame, sorted; their codes [rows, num_codebooks]). The closing
        frame is all `codebook_eos_token_id`, as transformers embeds `<|audio_eos|>`."""
        assert self.encoder is not None
        k = self.spec.num_codebooks
        where, closing = r.inputs["where"], r.inputs["closing"]
        parts, at = [], 0
        for clip, n in zip(r.inputs["clips"], r.inputs["frames"]):
            rows = where[at: at + n]
            cached = rows[-1] < r.num_computed  # the prefix cache holds them: never read
            codes = np.zeros((n, k), dtype=np.int64) if cached else self.encoder.encode(clip)
            if codes.shape != (n, k):
                raise ValueError(f"the encoder made {codes.shape} codes of a clip whose prompt holds {n} frames")
            parts.append(codes)
            at += n
        positions = np.concatenate([where, closing])
        codes = np.concatenate([*parts, np.full((len(closing), k), self.spec.codebook_eos, dtype=np.int64)])
        order = np.argsort(positions, kind="stable")
        return positions[order], torch.from_numpy(codes[order])

    def step_scratch(self, entry: PlanEntry) -> dict[str, int]:
        r = entry.request
        samples = r.num_computed + entry.rows == r.tokens_len
        return {self.depth_label.name: self.spec.depth_rows} if samples else {}

    # -- the step ----------------------------------------------------------------------

    def _sample_frames(self, hidden: torch.Tensor, entries: list[PlanEntry]) -> list[int]:
        """Each sampling entry's frame: its first code from the backbone's `hidden`, the
        others from the depth decoder; kept on the request, returned as its token."""
        reqs = [e.request for e in entries]
        logits = self._codes_only(self.model.first_code_logits(hidden))
        frame = self._frames(hidden, logits, entries, [self._depth_params(r) for r in reqs])
        out = []
        for f in frame:
            stop = all(c == self.spec.codebook_eos for c in f[:-1])
            out.append(self.spec.eos_frame_token if stop else f[0])
        return out

    def _frames(self, hidden: torch.Tensor, first_logits: torch.Tensor, entries: list[PlanEntry],
                depth_rows: list[Row]) -> list[list[int]]:
        """Each sampling entry's frame: its first code sampled from `first_logits` with the
        request's own sampling, the others by the depth decoder's loop (`num_codebooks - 1`
        steps batched over the entries, sampled with `depth_rows`); kept on the request
        (`last_frame`, `new_frames`). CSM's and Qwen3-TTS' (whose code predictor is this loop)."""
        reqs = [e.request for e in entries]
        codes = [torch.tensor(sample(first_logits, [Row(r.sampling, r.generator, (), r.output) for r in reqs])[0])]
        steps = {r.caps.get(self.spec.codebook_loop, 0) for r in reqs}
        if steps != {self.spec.num_codebooks - 1}:  # a frame needs every codebook
            raise ValueError(f"codebook_loop caps {sorted(steps)}; a frame takes {self.spec.num_codebooks - 1}")
        pages = [e.pages[self.depth_label.name] for e in entries]
        b = len(reqs)
        for k in range(self.spec.num_codebooks - 1):
            if k == 0:  # the backbone's hidden state and the first code, at positions 0 and 1
                pairs = torch.stack([hidden, self.model.code_embeds(codes[0].to(self.device), 0)], dim=1)
                inputs, new, head_rows = pairs.reshape(2 * b, -1), 2, torch.arange(1, 2 * b, 2, device=self.device)
            else:
                inputs, new = self.model.code_embeds(codes[k].to(self.device), k), 1
                head_rows = torch.arange(b, device=self.device)
            cached = 0 if k == 0 else k + 1
            meta = self.builder.build([AttnRows(p, 0, cached, new, k > 0) for p in pages],
                                      self.page_sizes[self.depth_label.name])
            pos = torch.arange(cached, cached + new, device=self.device).repeat(b)
            logits = self._depth_logits(self.model.depth(inputs, pos, self.depth_caches, meta, head_rows, k))
            codes.append(torch.tensor(sample(logits, depth_rows)[0]))
        frame = torch.stack(codes, dim=1).tolist()
        for r, f in zip(reqs, frame):
            r.inputs["last_frame"] = f
            r.inputs.setdefault("new_frames", []).append(f)
        return frame

    def _depth_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A depth step's logits as sampled: CSM's depth heads reach past the codebook."""
        return self._codes_only(logits)

    def _codes_only(self, logits: torch.Tensor) -> torch.Tensor:
        """Ids past the codec's codebook never sampled (it cannot decode them)."""
        if logits.shape[-1] > self.codec.codebook_size:
            logits[:, self.codec.codebook_size:] = float("-inf")
        return logits

    def _depth_params(self, r: Request) -> Row:
        """The depth decoder's sampling for `r`: its temperature, top-k, top-p, min-p."""
        sp = r.sampling
        return Row(SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p),
                   r.generator)

    # -- sound -------------------------------------------------------------------------

    def on_emit(self, request: Request, reply_to: str, output: Output) -> bool:
        if request.codec is None:
            request.codec = self.codec.stream(CHUNK_FRAMES * self.codec.samples_per_frame)
        frames = request.inputs.pop("new_frames", [])
        self.thread.submit(reply_to, output, self._sound, request.codec, frames, output.finish_reason is not None)
        return True

    def _sound(self, stream: MimiStream, frames: list[list[int]], last: bool) -> bytes:
        """The samples `frames` made final (in the codec thread); the rest on the last output."""
        chunks = []
        keep = []
        for f in frames:
            if stream.cut or all(c == self.spec.codebook_eos for c in f):
                stream.cut = True  # transformers' audio ends at the first all-zero frame
                continue
            keep.append(f)
        if keep:
            chunks.append(stream.push(np.asarray(keep)))
        if last:
            chunks.append(stream.finish())
        return sound_bytes(chunks)
