"""Continuous batching for encoder-decoder models (Whisper): audio in, text out.

The same public surface as `Engine` (`add`, `abort`, `has_work`, `step`, `fail_all`,
`running`, `waiting`) and the same KVManager calls, so footprints, admission, debug
asserts and page accounting work unchanged. What differs is the request's walk:

1. admission (oldest first, never skipping the head, at most `max_encodes_per_step` a
   step so running requests' next token is not held up by a burst of encodes): run the
   encoder on the request's features, `reserve_rows` + write each decoder layer's cross
   K/V of the 1500 frames into the "cross" label, and commit them as its one span;
2. prefill of the forced decoder prompt on "self" (its `ids` span), which samples the
   first token;
3. one decode row per step on "self" (growth on "decode_loop"), batched across requests,
   attending over its own "self" pages and over its "cross" pages.

A request ends on EOS (unless ignore_eos), at max_tokens, at the decoder's window, or at
its loop cap ("length"). The generation config's `suppress_tokens` (every step) and
`begin_suppress_tokens` (first token) are applied, as transformers' Whisper generate does.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from services.gpu_worker.attention import AttnMetadata, PrefillChunk, build_metadata
from services.gpu_worker.engine import EngineBase, StepResult
from services.gpu_worker.kv_manager import KVManager, LayoutViolation, RequestKV
from services.gpu_worker.sampler import make_generator, sample
from shared.errors import new_error_id
from shared.frames import NewRequest, Output, SamplingParams

log = logging.getLogger("mstar.encdec_engine")


def cross_metadata(rows: list[tuple[list[int], int, int]], page_size: int) -> AttnMetadata:
    """Metadata for attention over rows written earlier, with no causal order: every query
    of a request sees all of its `kv_len` rows. `rows` holds, per request in batch order,
    (its pages, rows held, query rows this step). Nothing is written (no slots); a request
    with one query row goes through the batched decode path, others as a chunk."""
    empty = torch.zeros(0, dtype=torch.long)
    indptr, indices, last_lens = [0], [], []
    decode_rows, decode_pages, decode_lens = [], [], []
    prefills: list[PrefillChunk] = []
    t = 0
    for pages, kv_len, q in rows:
        n_pages = -(-kv_len // page_size)
        used = list(pages[:n_pages])
        indices.extend(used)
        indptr.append(len(indices))
        last_lens.append(kv_len - (n_pages - 1) * page_size)
        if q == 1:
            decode_rows.append(t)
            decode_pages.append(used)
            decode_lens.append(kv_len)
        else:
            mask = torch.ones(q, kv_len, dtype=torch.bool)
            prefills.append(PrefillChunk(t, t + q, torch.tensor(used, dtype=torch.long), kv_len, mask))
        t += q
    meta = AttnMetadata(slot_pages=empty, slot_offsets=empty, prefills=prefills,
                        kv_indptr=torch.tensor(indptr, dtype=torch.int32),
                        kv_indices=torch.tensor(indices, dtype=torch.int32),
                        kv_last_page_len=torch.tensor(last_lens, dtype=torch.int32))
    if decode_rows:
        width = max(len(p) for p in decode_pages)
        padded = torch.zeros(len(decode_pages), width, dtype=torch.long)
        for b, p in enumerate(decode_pages):
            padded[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        j = torch.arange(width * page_size).unsqueeze(0)
        mask = j < torch.tensor(decode_lens).unsqueeze(1)
        meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        meta.decode_pages = padded
        meta.decode_mask = mask[:, None, None, :]
    return meta


@dataclass
class EncDecSequence:
    request_id: str
    reply_to: str
    sampling: SamplingParams
    max_tokens: int
    caps: dict[str, int]
    prompt: list[int]  # the forced decoder prompt
    features: torch.Tensor | None  # [1, n_mels, frames] until encoded, then dropped
    kv: RequestKV
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # "self" rows already in KV
    encoded: bool = False
    iters: int = 0  # decode-loop iterations run

    @property
    def tokens_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        return (self.prompt + self.output)[start:end]


class EncDecEngine(EngineBase):
    def __init__(self, model, spec, kv: KVManager, caches: dict[str, list[torch.Tensor]], *,
                 eos_ids: list[int], max_num_seqs: int, max_batch_tokens: int, max_seq_len: int,
                 max_encodes_per_step: int = 4) -> None:
        self.model = model
        self.spec = spec
        self.kv = kv
        self.loop = spec.decode_loop
        self.self_label, self.cross_label = spec.self_label, spec.cross_label
        self.self_caches = caches[spec.label(self.self_label).pool]
        self.cross_caches = caches[spec.label(self.cross_label).pool]
        self.self_page = kv.pools[spec.label(self.self_label).pool].config.page_size
        self.cross_page = kv.pools[spec.label(self.cross_label).pool].config.page_size
        self.n_frames = spec.n_frames
        self.eos = set(eos_ids)
        self.suppress = torch.tensor(sorted(getattr(spec, "suppress_tokens", ())), dtype=torch.long)
        self.begin_suppress = torch.tensor(sorted(getattr(spec, "begin_suppress_tokens", ())), dtype=torch.long)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_seq_len = max_seq_len
        self.max_encodes_per_step = max(1, max_encodes_per_step)
        self.dtype = next(model.parameters()).dtype
        self.waiting: deque[EncDecSequence] = deque()
        self.running: list[EncDecSequence] = []
        self.ids: dict[str, EncDecSequence] = {}

    # -- intake ----------------------------------------------------------------------

    def add(self, req: NewRequest, tensors: dict[str, np.ndarray]) -> None:
        """Ingest and queue an audio request; raises ValueError on one this worker refuses.

        `tensors`: "input_features" float [1, n_mels, 2 * n_frames] and
        "decoder_input_ids" int [P] (what `WhisperSpec.process_audio` makes)."""
        if req.request_id in self.ids:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.max_tokens is None or req.max_tokens < 1:
            raise ValueError("NewRequest reached the worker without max_tokens")
        missing = sorted({"input_features", "decoder_input_ids"} - set(tensors))
        if missing:
            raise ValueError(f"an encoder-decoder request needs tensors {missing}")
        if set(req.kv_layout) != {self.self_label, self.cross_label}:
            raise ValueError(f"an encoder-decoder request needs layouts for labels {self.self_label!r} and {self.cross_label!r}")
        feats = torch.from_numpy(np.ascontiguousarray(tensors["input_features"], dtype=np.float32))
        if feats.dim() == 2:
            feats = feats.unsqueeze(0)
        want = (1, self.spec.n_mels, self.spec.input_frames)
        if tuple(feats.shape) != want:
            raise ValueError(f"input_features must be {list(want)}, got {list(feats.shape)}")
        prompt = [int(t) for t in np.asarray(tensors["decoder_input_ids"]).reshape(-1)]
        if not prompt:
            raise ValueError("the decoder prompt is empty")
        kv = self.kv.ingest_request(req)
        if not self.kv.fits_at_all(kv):
            raise ValueError("footprint exceeds the pool")
        seq = EncDecSequence(req.request_id, req.reply_to, req.sampling, req.max_tokens, dict(req.loop_caps),
                             prompt, feats, kv, make_generator(req.sampling.seed))
        self.ids[seq.request_id] = seq
        self.waiting.append(seq)

    # -- admission: encode and write the cross rows -----------------------------------

    def _admit(self, res: StepResult) -> None:
        admitted: list[EncDecSequence] = []
        while self.waiting and len(admitted) < self.max_encodes_per_step and self._admissible():
            seq = self.waiting.popleft()
            hit = self.kv.admit(seq.kv)
            self.running.append(seq)
            if hit:  # the cross label is never keyed, so nothing may be shared
                error_id = new_error_id()
                log.error("request %s: %d prefix-cache rows on an encoder-decoder request (error_id=%s)", seq.request_id, hit, error_id)
                self._fail(seq, 500, "internal error", error_id, res)
                continue
            admitted.append(seq)
        if not admitted:
            return
        try:
            self._encode(admitted)
        except Exception:
            error_id = new_error_id()
            log.exception("encoder failed (error_id=%s); failing its %d requests", error_id, len(admitted))
            for seq in admitted:
                self._fail(seq, 500, "internal error in the encoder", error_id, res)
            return
        for seq in admitted:
            try:
                self.kv.commit(seq.request_id, self.cross_label, self.n_frames, None)
            except LayoutViolation as exc:
                self._violation(seq, exc, res)
                continue
            seq.encoded, seq.features = True, None

    def _encode(self, seqs: list[EncDecSequence]) -> None:
        rows = []
        for seq in seqs:
            pages = self.kv.reserve_rows(seq.request_id, self.cross_label, self.n_frames)
            rows.append((pages, 0, 0, self.n_frames, False))
        meta = build_metadata(rows, self.cross_page)
        feats = torch.cat([s.features for s in seqs]).to(self.dtype)
        with torch.inference_mode():
            enc = self.model.encode(feats)  # [B, n_frames, d]
            self.model.write_cross(enc.reshape(-1, enc.shape[-1]), self.cross_caches, meta)

    # -- one step --------------------------------------------------------------------

    def _schedule(self) -> list[tuple[EncDecSequence, int]]:
        budget = self.max_batch_tokens
        ready = [s for s in self.running if s.encoded]
        decodes = [s for s in ready if s.num_computed >= len(s.prompt)]
        batch = [(s, 1) for s in decodes]
        budget -= len(decodes)
        for s in ready:
            if s.num_computed < len(s.prompt):
                if budget <= 0:
                    break
                n = min(len(s.prompt) - s.num_computed, budget)
                batch.append((s, n))
                budget -= n
        return batch

    def _advance(self, seq: EncDecSequence, n: int) -> None:
        decode = seq.num_computed >= len(seq.prompt)
        self.kv.commit(seq.request_id, self.self_label, n, self.loop if decode else None)
        seq.num_computed += n
        if decode:
            seq.iters += 1

    def _forward(self, batch: list[tuple[EncDecSequence, int]]) -> list[list[int]]:
        self_rows, cross_rows = [], []
        ids, positions, sample_rows, sample_seqs = [], [], [], []
        t = 0
        for seq, n in batch:
            decode = seq.num_computed >= len(seq.prompt)
            pages = self.kv.reserve_rows(seq.request_id, self.self_label, n)
            self_rows.append((pages, 0, seq.num_computed, n, decode))
            cross = seq.kv.labels[self.cross_label]
            cross_rows.append((cross.pages, cross.rows, n))
            ids.extend(seq.token_slice(seq.num_computed, seq.num_computed + n))
            positions.extend(range(seq.num_computed, seq.num_computed + n))
            t += n
            if seq.num_computed + n == seq.tokens_len:
                sample_rows.append(t - 1)
                sample_seqs.append(seq)
        self_meta = build_metadata(self_rows, self.self_page)
        cross_meta = cross_metadata(cross_rows, self.cross_page)
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                self.self_caches, self_meta, self.cross_caches, cross_meta, torch.tensor(sample_rows, dtype=torch.long),
            ).float()
            self._suppress(logits, sample_seqs)
            toks = sample(logits, [s.sampling for s in sample_seqs], [s.generator for s in sample_seqs])
        by_seq = {id(s): tok for s, tok in zip(sample_seqs, toks)}
        return [[by_seq[id(seq)]] if id(seq) in by_seq else [] for seq, _ in batch]

    def _suppress(self, logits: torch.Tensor, seqs: list[EncDecSequence]) -> None:
        """The generation config's suppress lists, in place (-inf never samples)."""
        if self.suppress.numel():
            logits[:, self.suppress] = float("-inf")
        if self.begin_suppress.numel():
            first = [i for i, s in enumerate(seqs) if not s.output]
            if first:
                logits[torch.tensor(first).unsqueeze(1), self.begin_suppress.unsqueeze(0)] = float("-inf")

    def _emit(self, seq: EncDecSequence, toks: list[int], res: StepResult) -> None:
        (tok,) = toks  # one token per step: this engine does not speculate
        seq.output.append(tok)
        cap = seq.caps.get(self.loop, 0)
        finish = None
        if tok in self.eos and not seq.sampling.ignore_eos:
            finish = "stop"
        elif len(seq.output) >= seq.max_tokens or seq.tokens_len >= self.max_seq_len or seq.iters >= cap:
            finish = "length"  # max_tokens, the decoder's window, or the loop's cap: never run further
        res.outputs.append((seq.reply_to, Output(seq.request_id, [tok], finish, len(seq.prompt), len(seq.output))))
        if finish is not None:
            self._finish(seq, seq.iters >= cap, "ok", res)
